"""Folders shardtune writes for users (export OUT, OUTPUT_DIR/model, OUTPUT_DIR/adapter) never remove what
shardtune did not write: a file is refused, a foreign non-empty folder needs --overwrite, an earlier
output of the same kind (it carries shardtune's marker) is replaced. One real LoRA run on 1 process
gives the checkpoint the exports read (also the adapter export of an older checkpoint with a tied LM head)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import ROOT, one_line_error, run_cli, small_tmpfs

from shardtune.checkpoint.export import export_checkpoint
from shardtune.checkpoint.hf_export import save_hf_model
from shardtune.checkpoint.outdir import MARKER, staged, staging_dir
from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.validate import check_final_dir, validate

TINY = str(ROOT / "examples" / "tiny.yaml")


def _train_args(tmp: Path, out: Path) -> list[str]:
    data = tmp / "rows.jsonl"
    if not data.exists():
        rows = (ROOT / "examples" / "data" / "tasks.jsonl").read_text().splitlines()[:96]
        data.write_text("\n".join([*rows, '{"prompt": "no completion"}', "not json"]) + "\n")  # 2 bad rows
    return ["train", TINY, "--nproc", "1", "--output-dir", str(out), f"data.train_file={data}",
            "data.eval_fraction=0.1", "train.max_steps=1", "train.eval_batches=1", "log.progress=false",
            f"data.cache_dir={tmp / 'cache'}", "peft.method=lora"]


def _foreign(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"notes.txt": "my notes", "sub/data.csv": "a,b\n1,2\n"}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return files


def _intact(folder: Path, files: dict[str, str]) -> bool:
    return all((folder / name).read_text() == text for name, text in files.items())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run whose OUTPUT_DIR/adapter held a user's files: `train --overwrite` replaced them."""
    tmp = tmp_path_factory.mktemp("outdir")
    out = tmp / "run"
    _foreign(out / "adapter")
    proc = run_cli(*_train_args(tmp, out), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tmp / "train.stderr").write_text(proc.stderr)  # for test_train_reports_the_bad_rows_it_skipped
    return out


def _hidden_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_export_refuses_a_foreign_folder_and_keeps_its_files(run, tmp_path):
    out = tmp_path / "mine"
    files = _foreign(out)
    one_line_error(run_cli("export", str(run), str(out)), str(out), "did not write", "--overwrite")
    assert _intact(out, files) and sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    assert _hidden_leftovers(tmp_path) == []


def test_export_refuses_a_file_even_with_overwrite(run, tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"precious")
    one_line_error(run_cli("export", str(run), str(target), "--overwrite"), str(target), "is a file")
    for kwargs in ({}, {"merge_lora": True, "overwrite": True}):
        with pytest.raises(ShardtuneError, match="is a file"):
            export_checkpoint(str(run), target, **kwargs)
    assert target.read_bytes() == b"precious"


def test_overwrite_replaces_a_foreign_folder(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.models.init_model import init_model

    out = tmp_path / "mine"
    _foreign(out)
    export_checkpoint(str(run), out, overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "adapter_model.safetensors").is_file()
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "adapter" and marker["source"].endswith("step-00000001")
    assert _hidden_leftovers(tmp_path) == []
    base = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "base", "tiny-llama"))
    PeftModel.from_pretrained(base, out)  # still a PEFT adapter folder


def test_earlier_exports_of_the_same_kind_are_replaced_without_the_flag(run, tmp_path):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    adapter.mkdir()  # an empty folder is fine
    for _ in range(2):
        export_checkpoint(str(run), adapter)
        export_checkpoint(str(run), merged, merge_lora=True, dtype="fp32")
    assert (adapter / "adapter_model.safetensors").is_file() and (merged / "model.safetensors").is_file()
    assert json.loads((merged / MARKER).read_text())["kind"] == "model"
    with pytest.raises(ShardtuneError, match="holds a shardtune model export, not a adapter"):
        export_checkpoint(str(run), merged)
    with pytest.raises(ShardtuneError, match="holds a shardtune adapter export, not a model"):
        export_checkpoint(str(run), adapter, merge_lora=True)
    assert (merged / "model.safetensors").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert sorted(_hidden_leftovers(tmp_path)) == []


def test_training_writes_its_marker_and_may_run_again(run):
    marker = json.loads((run / "adapter" / MARKER).read_text())
    assert marker["kind"] == "adapter" and marker["source"] == f"training run {run}"
    assert not (run / "adapter" / "notes.txt").exists()  # train --overwrite replaced the user's files
    cfg = load_config(TINY, [f"train.output_dir={run}", "peft.method=lora"])
    with pytest.raises(ShardtuneError, match="holds a finished run"):
        check_final_dir(cfg)  # it finished there: a new run must resume it or say --overwrite
    cfg = load_config(TINY, [f"train.output_dir={run}", "peft.method=lora", "checkpoint.resume=auto"])
    check_final_dir(cfg)  # resuming it may replace its own adapter at the end


def test_train_refuses_a_foreign_final_folder_before_starting(tmp_path):
    out = tmp_path / "run"
    files = _foreign(out / "model")
    args = [a for a in _train_args(tmp_path, out) if a != "peft.method=lora"]
    one_line_error(run_cli(*args), str(out / "model"), "did not write", "--overwrite", "shardtune train")
    assert _intact(out / "model", files)
    assert sorted(p.name for p in out.iterdir()) == ["model"]  # refused before anything was written
    (out / "model" / "notes.txt").unlink()
    (out / "model" / "sub" / "data.csv").unlink()
    (out / "model" / "sub").rmdir()
    (out / "model").rmdir()
    (out / "model").write_text("a file")
    with pytest.raises(ShardtuneError, match="model is a file"):
        validate(TINY, [f"train.output_dir={out}"], quiet=True, overwrite=True)
    cfg = load_config(TINY, [f"train.output_dir={out}", "checkpoint.save_final=false"])
    check_final_dir(cfg)  # nothing is written at the end: nothing to refuse


def test_a_folder_changed_during_the_run_is_kept_and_the_result_moved_aside(tmp_path):
    """Training checks at its start; at its end the swap checks again and, refusing, keeps both."""
    out = tmp_path / "model"
    with pytest.raises(ShardtuneError) as err, staged(out, "model", "test", check_first=False) as tmp:
        (tmp / "model.safetensors").write_text("weights")
        files = _foreign(out)  # what a user put there meanwhile
    assert _intact(out, files)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("model-")]
    assert len(kept) == 1 and (kept[0] / "model.safetensors").read_text() == "weights"
    assert str(kept[0]) in str(err.value) and "\n" not in str(err.value)


def test_a_failed_write_leaves_the_earlier_output_and_no_staging_folder(tmp_path):
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.models.tokenizer import load_tokenizer
    from shardtune.models.weights import RandomInitSource, load_weights

    cfg = preset_config("tiny-llama")
    model = build_on_meta(cfg)
    load_weights(model, RandomInitSource(0.02, seed=0), torch.device("cpu"))
    out = tmp_path / "model"
    save_hf_model(model, cfg, load_tokenizer(None), out, dtype=torch.float32, max_shard_bytes=10**9, rank=0)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError), staged(out, "model", "test") as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise ValueError("interrupted")
    assert (out / "model.safetensors").read_bytes() == before and _hidden_leftovers(tmp_path) == []


def test_only_abandoned_staging_folders_of_shardtune_are_cleaned_up(tmp_path):
    out = tmp_path / "export"
    dead = staging_dir(out, "model", "test")
    alive = staging_dir(out, "model", "test")  # this process: still writing
    gone_pid = dead.with_name(f".export.tmp-{2**22 + 12345}-abcdef01")  # above Linux's pid_max: no such process
    os.replace(dead, gone_pid)
    foreign = tmp_path / f".export.tmp-{2**22 + 12345}-user"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not shardtune's")
    staging_dir(out, "model", "test")
    assert not gone_pid.exists() and alive.is_dir() and (foreign / "keep.txt").is_file()


def test_adapter_export_of_an_older_checkpoint_leaves_out_the_tied_lm_head(run, tmp_path):
    """FSDP2 LoRA checkpoints written before the fix hold the frozen, tied LM head (57 tensors for 56
    adapters); the exported adapter holds the adapters only. (This run's own checkpoint is the model
    of one: the same tensors plus the head.)"""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint.export import checkpoint_tensors
    from shardtune.checkpoint.layout import finalize, resolve_checkpoint
    from shardtune.models.init_model import init_model

    step = resolve_checkpoint(str(run))
    adapters = {f"model.{n}": t.load() for n, t in checkpoint_tensors(step).items()}
    assert adapters and all(".lora_" in n for n in adapters)
    old = tmp_path / ".step-00000001.tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**adapters, "model.base_model.model.lm_head.weight": torch.randn(512, 64)},
                 checkpoint_id=str(old), no_dist=True)
    shutil.copytree(step / "hf", old / "hf")
    finalize(old, tmp_path / "step-00000001", {"step": 1, "world_size": 1})
    assert len(checkpoint_tensors(tmp_path / "step-00000001")) == len(adapters) + 1
    out = export_checkpoint(str(tmp_path / "step-00000001"), tmp_path / "adapter")
    state = load_file(str(out / "adapter_model.safetensors"))
    assert set(state) == {n.removeprefix("model.").replace(".default", "") for n in adapters}
    base = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "base", "tiny-llama"))
    PeftModel.from_pretrained(base, out)


def test_a_model_that_does_not_fit_on_the_disk_is_one_line_and_leaves_nothing(tmp_path):
    """The final model (or an export) onto a full disk: refused before writing when the free space is below the
    model's bytes; else, when a write fails for lack of space, the same kind of line and no staging folder left."""
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.models.tokenizer import load_tokenizer
    from shardtune.models.weights import RandomInitSource, load_weights

    cfg = preset_config("tiny-llama")
    model = build_on_meta(cfg)
    load_weights(model, RandomInitSource(0.02, seed=0), torch.device("cpu"))
    needed = sum(p.numel() * 4 for p in model.parameters())  # fp32; a tied weight once
    save = dict(dtype=torch.float32, max_shard_bytes=10**9, rank=0)
    with small_tmpfs(tmp_path / "small", "1m") as disk:
        with pytest.raises(ShardtuneError) as err:
            save_hf_model(model, cfg, load_tokenizer(None), disk / "model", **save)
        assert str(err.value).startswith(f"the model was not written: {disk} has 1.0 MB free and the model takes ")
        assert list(disk.iterdir()) == []
    # Room for the tensors' bytes (the check passes), not for them with the file headers and shardtune's marker.
    with small_tmpfs(tmp_path / "exact", str(-(-needed // 4096) * 4096)) as disk:
        with pytest.raises(ShardtuneError) as err:
            save_hf_model(model, cfg, load_tokenizer(None), disk / "model", **save)
        assert str(err.value).startswith(f"the model was not written: no space left on the disk of {disk} (the "
                                         "model takes ")
        assert "\n" not in str(err.value) and list(disk.iterdir()) == []


def _modes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): oct(p.stat().st_mode & 0o777) for p in folder.rglob("*") if p.is_file()}


def test_every_file_written_gets_the_umask_mode(run, tmp_path):
    """safetensors' save_file leaves 0600 (a private temporary file renamed): a model folder others could not
    read. Every file a run and an export write gets 0666 less the umask, as any other program's files."""
    from shardtune.fileio import umask
    from shardtune.models.init_model import init_model

    usual = oct(0o666 & ~umask())
    init_model(tmp_path / "base", "tiny-llama")
    export_checkpoint(str(run), tmp_path / "adapter")
    export_checkpoint(str(run), tmp_path / "merged", merge_lora=True, dtype="fp32")
    for folder in (run, tmp_path):
        modes = _modes(folder)
        assert any(name.endswith(".safetensors") for name in modes), modes
        assert {name: mode for name, mode in modes.items() if mode != usual} == {}, usual


def test_train_reports_the_bad_rows_it_skipped(run):
    """As validate does: one line at the start of training with the count per reason (not silent skipping)."""
    lines = [line for line in (run.parent / "train.stderr").read_text().splitlines()
             if line.startswith("data: skipped")]
    assert len(lines) == 1, lines
    assert "2 bad rows in " in lines[0] and "rows.jsonl" in lines[0] and "shardtune validate" in lines[0]
    assert lines[0].count("1 ") >= 2  # one of each reason
