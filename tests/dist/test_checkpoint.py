"""Checkpoints through the CLI on gloo processes: resume parity, resharding across world sizes
and strategies, kill -9 during a save, async == sync, export round trip. Commands run in this process
(conftest.run_cli: the launcher here, its torchrun workers as real processes), except where a test signals or
kills the launcher, which runs the real command in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MICRO, ROOT, _env, descendants, one_line_error, run_cli

from shardtune.checkpoint.dcp_files import SafeReader, read_tensor
from shardtune.checkpoint.layout import complete_checkpoints, is_complete, resolve_checkpoint, verify
from shardtune.stop import alive

pytestmark = pytest.mark.dist

TINY = str(ROOT / "examples" / "tiny.yaml")
STEPS = 8


@pytest.fixture(scope="module")
def cache(data_cache):
    return str(data_cache)


def train(out: Path, cache: str, *extra: str, nproc: int = 2, strategy: str = "zero3", accum: int = 2):
    args = ["train", TINY, MICRO, "--nproc", str(nproc), "--output-dir", str(out), f"train.max_steps={STEPS}",
            "train.micro_batch_size=4", f"train.grad_accum={accum}", f"parallel.strategy={strategy}",
            "log.every=1", "log.progress=false", "train.eval_batches=1", "checkpoint.every_steps=3",
            f"data.cache_dir={cache}", *extra]
    proc = run_cli(*args)  # the launcher in this process, its workers as the real command starts them
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache):
    """Uninterrupted: 2 processes, zero3, grad_accum 2 (16 sequences per step), 8 steps; its run directory (ends
    with a checkpoint at step 8 and the gathered model in model/). Read only: tests copy what they change."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(out, cache)
    return out


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's loss per step."""
    return losses(reference_run)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, cache):
    """The same run stopped after step 5 (mid-epoch, checkpoints at 3 and 5). Started with `--resume auto` into
    an empty directory (as a scheduler's requeued job is): it starts fresh. Its stderr is in stopped/../stderr.txt."""
    out = tmp_path_factory.mktemp("stop") / "run"
    proc = train(out, cache, "train.stop_after_step=5", "--resume", "auto")
    (out.parent / "stderr.txt").write_text(proc.stderr)
    return out


def test_stop_leaves_complete_checkpoints_and_no_model(stopped):
    assert [p.name for p in complete_checkpoints(stopped / "checkpoints")] == ["step-00000003", "step-00000005"]
    assert not (stopped / "model").exists()
    verify(resolve_checkpoint("auto", stopped / "checkpoints"))  # sizes and CRC32 of every file


def test_resume_gives_the_uninterrupted_trajectory(tmp_path, stopped, reference, cache):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = train(out, cache, "--resume")
    assert "resumed from" in proc.stderr and "step-00000005" in proc.stderr
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # steps 1-5 kept, 6-8 new, none twice
    assert max(abs(resumed[s] - reference[s]) for s in reference) <= 1e-6


def test_a_flipped_byte_refuses_export_and_resume_auto_falls_back(tmp_path, stopped, reference, cache, cli):
    """Same size, one byte changed in a shard of the newest checkpoint: only the checksum sees it. Export of
    that checkpoint is refused naming the file; --resume auto says so and resumes from the one before (step 3),
    and the run still ends on the uninterrupted trajectory."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    newest = out / "checkpoints" / "step-00000005"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    refused = cli("export", str(newest), str(tmp_path / "hf"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"{newest} is damaged: {shard.name} does not match the manifest" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()
    proc = train(out, cache, "--resume")
    assert f"{shard.name} does not match the manifest" in proc.stderr
    assert "falling back to the previous checkpoint" in proc.stderr and "step-00000003" in proc.stderr
    assert proc.stderr.count("does not match the manifest") == 1  # read back once (the launcher), not per rank
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - reference[s]) for s in reference) <= 1e-6


@pytest.mark.parametrize(("nproc", "strategy"), [(4, "zero2"), (2, "ddp")])
def test_reshard_two_process_checkpoint(tmp_path, stopped, reference, cache, nproc, strategy):
    # 2 -> 4 processes, zero3 -> zero2 / ddp: DCP reshards on load; grad_accum is adjusted
    # so every step keeps its 16 sequences.
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = train(out, cache, "--resume", nproc=nproc, strategy=strategy)
    assert ("keeps the checkpoint's 16 sequences per step" in proc.stderr) == (nproc != 2)
    resumed = losses(out)
    assert max(abs(resumed[s] - reference[s]) for s in range(6, STEPS + 1)) < 1e-5


def test_reshard_into_and_out_of_hsdp(tmp_path, stopped, reference, cache):
    # 2-process zero3 at step 5 -> 4-process hsdp (2 groups of 2) to step 7 -> 2-process zero3 to the end:
    # DCP loads into and saves from the (replicate, shard) mesh.
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = train(out, cache, "--resume", "train.stop_after_step=7", "parallel.shard_size=2", nproc=4,
                 strategy="hsdp")
    assert "resumed from" in proc.stderr and "step-00000005" in proc.stderr
    train(out, cache, "--resume", nproc=2, strategy="zero3")
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - reference[s]) for s in reference) < 1e-5


def test_reshard_two_processes_to_one_and_back(tmp_path, stopped, reference, cache):
    # 2-process zero3 at step 5 -> 1-process zero2 (grad_accum 4) to step 7 -> 2-process zero3 to the end: DCP
    # reshards on load both ways, and the global batch of 16 sequences is kept.
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = train(out, cache, "--resume", "train.stop_after_step=7", nproc=1, strategy="zero2")
    assert "keeps the checkpoint's 16 sequences per step" in proc.stderr and "step-00000005" in proc.stderr
    proc = train(out, cache, "--resume", nproc=2, strategy="zero3")
    assert "step-00000007" in proc.stderr
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - reference[s]) for s in reference) < 1e-5


def test_a_checkpoint_of_another_model_is_refused_before_any_process_starts(tmp_path, stopped, cli):
    """A full fine-tune's checkpoint resumed as LoRA (or into a model of another shape) stops with one line."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = cli("train", TINY, MICRO, "--output-dir", str(out), "peft.method=lora", "--resume")
    one_line_error(proc, "tensor(s) this model does not have", "another model or peft setting", "--resume")
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]  # nothing ran


def test_resume_auto_without_checkpoint_starts_fresh_and_bad_path_is_refused(tmp_path, stopped, cli):
    err = (stopped.parent / "stderr.txt").read_text()  # `--resume auto` into a directory without checkpoints
    assert "resumed from" not in err and "Traceback" not in err
    assert sorted(losses(stopped)) == [1, 2, 3, 4, 5]  # trained from step 1
    bad = cli("train", TINY, "--resume", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "x"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: checkpoint")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path, cache):
    out = tmp_path / "run"
    root = out / "checkpoints"
    cmd = [sys.executable, "-m", "shardtune", "train", TINY, MICRO, "--nproc", "2", "--output-dir", str(out),
           "train.max_steps=2000", "checkpoint.every_steps=1", "checkpoint.keep_last=3", "log.progress=false",
           "train.eval_batches=1", f"data.cache_dir={cache}", "log.report=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_mid_save = False
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if len(complete_checkpoints(root)) >= 2 and any(root.glob(".step-*.tmp")):
                for pid in reversed(descendants(proc.pid)):  # the launcher, torchrun's agent, the workers
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                killed_mid_save = True
                break
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    assert killed_mid_save, "never caught a save in progress"
    time.sleep(1)  # let the killed workers go
    partial = list(root.glob(".step-*.tmp"))
    assert partial  # the interrupted save is there, half written, and not a checkpoint
    newest = resolve_checkpoint("auto", root)
    assert newest is not None and is_complete(newest)
    verify(newest)
    step = int(newest.name.split("-")[1])
    proc2 = run_cli("train", TINY, MICRO, "--nproc", "2", "--output-dir", str(out), "train.max_steps=2000",
                      f"train.stop_after_step={step + 2}", "checkpoint.every_steps=1", "log.progress=false",
                      "train.eval_batches=1", f"data.cache_dir={cache}", "--resume", "auto")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"resumed from {newest}" in proc2.stderr
    assert not list(root.glob(".step-*.tmp"))  # the stale partial save was cleared
    assert is_complete(root / f"step-{step + 2:08d}")


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = SafeReader(str(path)).read_metadata()
    return {k: read_tensor(path, k, m) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_save_equals_sync_save(tmp_path, cache, stopped, writer):
    sync, asyn = stopped, tmp_path / "async"  # the stopped run saved synchronously at steps 3 and 5
    proc = train(asyn, cache, "train.stop_after_step=5", "checkpoint.async=true", f"checkpoint.async_writer={writer}")
    logs = sorted(p.name for p in (asyn / "checkpoints").glob("writer-rank*.log"))
    if writer == "process":  # DCP's writer processes log each save there, not among the run's output
        assert logs == ["writer-rank0.log", "writer-rank1.log"]
        assert "Completed checkpoint save request" in (asyn / "checkpoints" / "writer-rank1.log").read_text()
        assert "checkpoint save request" not in proc.stderr + proc.stdout
    else:
        assert logs == []
    for step in ("step-00000003", "step-00000005"):
        a, b = _all_tensors(sync / "checkpoints" / step), _all_tensors(asyn / "checkpoints" / step)
        assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert losses(sync) == losses(asyn)


def test_export_round_trip_through_transformers(tmp_path, reference_run, cli):
    from transformers import AutoModelForCausalLM

    out = reference_run  # ends with a checkpoint at step 8 and the gathered model in out/model
    exported = tmp_path / "exported"
    proc = cli("export", str(out), str(exported), "--dtype", "fp32", "--max-shard-size", "200KB")
    assert proc.returncode == 0, proc.stderr
    assert len(list(exported.glob("model-*.safetensors"))) > 1 and (exported / "tokenizer.json").is_file()
    a = AutoModelForCausalLM.from_pretrained(exported)
    b = AutoModelForCausalLM.from_pretrained(out / "model")
    ids = torch.arange(4, 60).view(2, -1)
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    bf16 = tmp_path / "bf16"
    assert cli("export", str(out / "checkpoints" / "step-00000008"), str(bf16), "--dtype", "bf16").returncode == 0
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def _trainable_names() -> list[str]:
    """The parameters a LoRA run of micro-llama (r=8, default targets) trains, as PEFT names them."""
    from shardtune.config import PeftConfig
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.peft.lora import apply_lora

    model = apply_lora(build_on_meta(preset_config("micro-llama")), PeftConfig(r=8, alpha=16), "llama")
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _records(out: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


def test_lora_resume_and_adapter_and_merged_export(tmp_path, cache, cli):
    """LoRA with dropout 0.1 draws from each rank's RNG every step, so the resumed run equals the uninterrupted one
    only if the checkpoint restored the RNG: asserted with ==, CPU fp32 on the same 2 processes. 64 rows (3 steps
    of 16 sequences per epoch) put the resume at step 4, mid epoch 1, and steps 7-8 in epoch 2 (a new order)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.checkpoint.dcp_files import model_tensors
    from shardtune.models.init_model import init_model

    base_dir = init_model(tmp_path / "base", "micro-llama")
    data = tmp_path / "small.jsonl"
    data.write_text("".join((ROOT / "examples" / "data" / "tasks.jsonl").read_text().splitlines(True)[:64]))
    lora = ["peft.method=lora", "peft.r=8", "peft.alpha=16", "peft.dropout=0.1", "model.preset=null",
            f"model.path={base_dir}", f"data.train_file={data}"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    train(ref, cache, *lora)
    train(out, cache, *lora, "train.stop_after_step=4")
    ckpt = resolve_checkpoint(str(out))
    # adapter + optimizer only: the whole model's fp32 weights and two Adam moments would be 12 bytes per parameter
    # (measured: 0.58 MB, a third of it DCP's per-tensor framing at this size, against 1.58 MB for the model's)
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base_dir).parameters())
    assert sum(f.stat().st_size for f in ckpt.glob("*.distcp")) < 12 * total / 2
    # micro-llama ties its LM head to the embedding: that frozen matrix is in no checkpoint under either name
    assert AutoConfig.from_pretrained(base_dir).tie_word_embeddings
    saved = set(model_tensors(ckpt))
    assert saved == set(_trainable_names()), sorted(saved - set(_trainable_names()))
    # Another LoRA rank does not fit the checkpoint: refused before any process starts, naming a tensor.
    lora4 = [a.replace("peft.r=8", "peft.r=4") for a in lora]
    wrong = cli("train", TINY, MICRO, "--output-dir", str(out), f"data.cache_dir={cache}", *lora4, "--resume")
    one_line_error(wrong, "does not fit this model", "down_proj.lora_A", "[8, 192] there and [4, 192] here",
                   "config.yaml")
    proc = train(out, cache, *lora, "--resume")
    assert "step-00000004" in proc.stderr
    want, got = _records(ref), _records(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert len({r["epoch"] for r in got.values()}) == 3 and got[4]["epoch"] == 1  # resumed mid-epoch, crossed one
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in want.items()}
    assert {s: r["grad_norm"] for s, r in got.items()} == {s: r["grad_norm"] for s, r in want.items()}

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    trained = PeftModel.from_pretrained(base, out / "adapter")
    ids = torch.arange(4, 60).view(2, -1)
    expected = trained(input_ids=ids).logits
    adapter = tmp_path / "adapter"
    assert cli("export", str(out), str(adapter)).returncode == 0
    expected_names = {n.replace(".default", "") for n in _trainable_names()}
    assert set(load_file(str(adapter / "adapter_model.safetensors"))) == expected_names  # 28, no LM head
    assert set(load_file(str(out / "adapter" / "adapter_model.safetensors"))) == expected_names
    for folder in (out / "adapter", adapter):  # both name the base folder a user can load, and say how
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base_dir.resolve()), folder
        assert f"from_pretrained('{base_dir.resolve()}')" in (folder / "README.md").read_text()
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-5)
    merged = tmp_path / "merged"
    proc = cli("export", str(out), str(merged), "--merge-lora", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert torch.allclose(AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits, expected, atol=1e-4)


def test_qlora_adapter_and_merged_export_equal_the_4bit_model(tmp_path, cache, cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.models.init_model import init_model
    from shardtune.peft.qlora import quantize_to_nf4

    base_dir = init_model(tmp_path / "base", "micro-llama")
    out = tmp_path / "run"
    train(out, cache, "peft.method=qlora", "peft.r=8", "model.preset=null", f"model.path={base_dir}")
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter")
    quantize_to_nf4(trained, lambda n: n.endswith(".base_layer"), shard_world=8)  # what training saw
    merged = tmp_path / "merged"
    proc = cli("export", str(out), str(merged), "--merge-lora", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = torch.arange(4, 60).view(2, -1)
    with torch.no_grad():
        diff = (AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits - trained(input_ids=ids).logits)
    assert diff.abs().max() < 1e-4


def test_qlora_on_one_process_resumes_exactly(tmp_path, cache):
    # One process: FSDP2 shards the adapters and ignores the NF4 weights; the checkpoint holds the
    # adapters and their optimizer state, the 4-bit base is quantised again on resume.
    qlora = ("peft.method=qlora", "peft.r=8", "checkpoint.save_final=false")
    full, part = tmp_path / "full", tmp_path / "part"
    train(full, cache, *qlora, nproc=1)
    train(part, cache, *qlora, "train.stop_after_step=3", nproc=1)
    proc = train(part, cache, *qlora, "--resume", nproc=1)
    assert "resumed from" in proc.stderr
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-6
    assert b[STEPS] < b[1]


# --- Signals: a scheduler's SIGTERM, SIGUSR1, and a launcher killed with kill -9 -------------------------------

def _start(out: Path, cache: str, *extra: str, steps: int = STEPS) -> tuple[subprocess.Popen, Path]:
    """`shardtune train` as in `train` (the reference's config), in its own process group, stderr to a file."""
    out.mkdir(parents=True)
    log = out.parent / "stderr.txt"
    cmd = [sys.executable, "-m", "shardtune", "train", TINY, MICRO, "--nproc", "2", "--output-dir", str(out),
           f"train.max_steps={steps}", "train.micro_batch_size=4", "train.grad_accum=2", "parallel.strategy=zero3",
           "log.every=1", "log.progress=false", "train.eval_batches=1", f"data.cache_dir={cache}", "log.report=false",
           *extra]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    return proc, log


def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no {text!r} in {timeout} s"
        time.sleep(0.02)


def _reap(proc: subprocess.Popen, pids: list[int]) -> None:
    """Never leave a process of a test behind, whatever it asserted."""
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_sigterm_saves_the_current_step_and_resume_continues_exactly(tmp_path, reference, cache):
    out = tmp_path / "run"
    proc, log = _start(out, cache, "checkpoint.every_steps=100")
    try:
        _wait_for(proc, log, "step 0: eval")  # the workers are in the loop, their handlers in place
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=240)
    finally:
        _reap(proc, [])
    err = log.read_text()
    assert code == 143, err[-3000:]
    assert "Traceback" not in err
    stopped = losses(out)
    step = max(stopped)
    assert step < STEPS  # stopped mid-run, after the step it was in
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == [f"step-{step:08d}"]
    assert f"stopped by SIGTERM after step {step} of {STEPS}" in err and "--resume auto" in err
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"
    assert not (out / "model").exists()
    proc2 = train(out, cache, "--resume", "auto")
    assert f"resumed from {out / 'checkpoints' / f'step-{step:08d}'}" in proc2.stderr
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - reference[s]) for s in reference) <= 1e-6


def test_sigusr1_saves_and_the_run_goes_on(tmp_path, reference, cache):
    out = tmp_path / "run"
    proc, log = _start(out, cache, "checkpoint.every_steps=100", "checkpoint.keep_last=5")
    try:
        _wait_for(proc, log, "step 0: eval")
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=240)
    finally:
        _reap(proc, [])
    err = log.read_text()
    assert code == 0, err[-3000:]
    saved = [int(p.name.split("-")[1]) for p in complete_checkpoints(out / "checkpoints")]
    assert len(saved) == 2 and saved[0] < STEPS and saved[1] == STEPS  # the asked-for one, and the last
    assert f"saved a checkpoint at step {saved[0]} (SIGUSR1)" in err
    assert (out / "model").is_dir()
    assert max(abs(losses(out)[s] - reference[s]) for s in reference) <= 1e-6  # saving changed nothing


def test_kill_9_of_the_launchers_group_leaves_no_worker(tmp_path, cache):
    out = tmp_path / "run"
    proc, log = _start(out, cache, "checkpoint.every_steps=1", steps=2000)
    pids: list[int] = []
    try:
        _wait_for(proc, log, "step 0: eval")
        pids = [p for p in descendants(proc.pid) if p != proc.pid]
        assert len(pids) >= 2  # the two workers (and any helper processes of theirs)
        os.killpg(proc.pid, signal.SIGKILL)  # the workers run in sessions of their own: this does not reach them
        proc.wait()
        deadline = time.time() + 10  # PR_SET_PDEATHSIG kills them at once; allow a slow machine 10 s
        while (left := [p for p in pids if alive(p)]) and time.time() < deadline:
            time.sleep(0.1)
        assert not left, f"workers still running after the launcher was killed: {left}"
        before = sorted((p.name, p.stat().st_size) for p in out.rglob("*") if p.is_file())
        time.sleep(1)
        assert sorted((p.name, p.stat().st_size) for p in out.rglob("*") if p.is_file()) == before
    finally:
        _reap(proc, pids)


# --- Two "nodes" on one host: two `shardtune train` launchers meeting at a loopback rendezvous -------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, reference):
    """The reference's run on two "nodes" of 2 processes each (4 ranks, hsdp with the default shard size: the
    processes per node): two launchers, node ranks 0 and 1, one c10d rendezvous on 127.0.0.1; the same 16 sequences
    per step (4 ranks x 4, no accumulation). Both nodes start with an empty tokenization cache they share (as on a
    shared file system), so both tokenize into it at once. Node 1 dies (kill -9 of its launcher and workers) once
    the step-5 checkpoint is in place. Its run directory, node 0's exit code, stderr, and seconds from the kill to
    its exit."""
    out = tmp_path_factory.mktemp("nodes") / "run"
    cache = out.parent / "shared_cache"
    common = ["train", TINY, MICRO, "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
              "--rdzv-id", "two-nodes", "--output-dir", str(out), f"train.max_steps={STEPS}",
              "train.micro_batch_size=4", "train.grad_accum=1", "parallel.strategy=hsdp", "log.every=1",
              "log.progress=false", "train.eval_batches=1", "checkpoint.every_steps=1", f"data.cache_dir={cache}",
              "log.report=false"]
    logs = [out.parent / f"node{n}.txt" for n in (0, 1)]
    procs = []
    try:
        for n, log in enumerate(logs):
            with log.open("w") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", "shardtune", *common, "--node-rank", str(n)],
                                              cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err))
        deadline = time.time() + 400
        while not is_complete(out / "checkpoints" / "step-00000005"):
            assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-3000:] for log in logs)
            assert time.time() < deadline, "no step-5 checkpoint in 400 s"
            time.sleep(0.05)
        for pid in descendants(procs[1].pid):  # node 1 dies: launcher and workers at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.time()
        code = procs[0].wait(timeout=300)
        took = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                _reap(p, descendants(p.pid))
    return out, code, logs[0].read_text(), took


def test_two_nodes_match_one_node_a_dead_node_is_one_line_and_the_checkpoint_resumes(
        two_nodes, reference, reference_run, cache, tmp_path, cli):
    """Losses of the 4-rank two-node hsdp run equal the reference's and those of a one-process run,
    with the data both nodes tokenized at once into one shared cache: it holds one complete store per data set
    and no half-written one.
    When node 1 dies, node 0 stops within a bounded time with exit code 2 and one line naming the newest complete
    checkpoint; that checkpoint (each rank checksummed its own files) resumes on 1 process (grad_accum 4) and on 2
    (zero3, grad_accum 2: the reference's own setting), each ending on the reference's trajectory and final weights,
    and exports to a directory transformers loads."""
    from transformers import AutoModelForCausalLM

    run, code, err, took = two_nodes
    assert code == 2, err[-4000:]
    assert "Traceback" not in err and took < 120
    errors = {line for line in err.splitlines() if line.startswith("error:")}
    newest = complete_checkpoints(run / "checkpoints")[-1]
    assert len(errors) == 1, err[-4000:]  # each of node 0's ranks may say it: the same line
    line = errors.pop()
    assert "lost a process of the run" in line and f"the newest complete checkpoint is {newest}" in line
    step = int(newest.name.split("-")[1])
    assert step >= 5
    got = losses(run)  # the checkpointed step's own record may be lost: node 1 died between the save and the log
    assert set(range(1, step)) <= set(got)
    assert max(abs(got[s] - reference[s]) for s in got) <= 1e-5
    # ...and equal those of one process (zero2, grad_accum 4: the same 16 sequences per step), step for step.
    single = tmp_path / "one"
    train(single, cache, nproc=1, strategy="zero2", accum=4)
    one = losses(single)
    assert sorted(one) == list(range(1, STEPS + 1)) and max(abs(got[s] - one[s]) for s in got) <= 1e-5
    # The cache both nodes tokenized into at once: one whole store (the tiny task set), nothing half-written.
    stores = sorted((run.parent / "shared_cache").iterdir())
    assert len(stores) == 1 and not stores[0].name.startswith("."), stores
    assert {f.name for f in stores[0].iterdir()} == {"input_ids.npy", "offsets.npy", "trainable.npy", "meta.json"}
    # Each rank checksummed its own shard and RNG files (rank 0 read none of the other node's files).
    files = json.loads((newest / "manifest.json").read_text())["files"]
    for rank in range(4):
        own = [name for name in files if name.startswith(f"__{rank}_") or name == f"rng/rank{rank}.safetensors"]
        assert len(own) >= 2 and all(files[name]["by"] == rank for name in own), (rank, own)
    out = tmp_path / "run"
    shutil.copytree(run, out)
    proc = train(out, cache, "--resume", nproc=1, strategy="zero2", accum=4)
    assert f"resumed from {out / 'checkpoints' / newest.name}" in proc.stderr
    resumed = losses(out)
    assert set(range(1, STEPS + 1)) - {step} <= set(resumed) <= set(range(1, STEPS + 1))
    assert max(abs(resumed[s] - reference[s]) for s in resumed) <= 1e-5
    exported = tmp_path / "hf"
    assert cli("export", str(newest), str(exported)).returncode == 0
    ids = torch.tensor([[1, 5, 9, 13]])
    assert torch.isfinite(AutoModelForCausalLM.from_pretrained(exported)(input_ids=ids).logits).all()
    final, ref = (AutoModelForCausalLM.from_pretrained(d / "model").state_dict() for d in (out, reference_run))
    assert max((final[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5
    # The 4-rank checkpoint on 2 ranks: the steps after it (at most 3, each the reference's 16 sequences) are new.
    two = tmp_path / "run2"
    shutil.copytree(run, two)
    proc = train(two, cache, "--resume", nproc=2, strategy="zero3", accum=2)
    assert f"resumed from {two / 'checkpoints' / newest.name}" in proc.stderr
    resumed = losses(two)
    assert step < STEPS and set(range(step + 1, STEPS + 1)) <= set(resumed)
    assert max(abs(resumed[s] - reference[s]) for s in range(step + 1, STEPS + 1)) <= 1e-5
    final = AutoModelForCausalLM.from_pretrained(two / "model").state_dict()
    assert max((final[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5


def test_a_checkpoint_dir_not_every_node_sees_is_refused_at_the_start(tmp_path, cache):
    """Two "nodes" of 1 process each, started in folders of their own with the same `--output-dir run`: one config
    string, a folder per node, as with a node-local disk. Node 1's first rank does not see rank 0's marker, so the
    run stops before the model is built: node 0's launcher exits 2 with one line naming the folder and the fix, and
    nothing is trained or saved on either node (max_steps 2 keeps a run the check let through short)."""
    port = _free_port()
    homes = [tmp_path / f"node{n}" for n in (0, 1)]
    procs, logs = [], [tmp_path / f"node{n}.txt" for n in (0, 1)]
    try:
        for n, home in enumerate(homes):
            home.mkdir()
            cmd = [sys.executable, "-m", "shardtune", "train", TINY, MICRO, "--nproc", "1", "--nnodes", "2",
                   "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "not-shared",
                   "--output-dir", "run", "train.max_steps=2", "log.progress=false", f"data.cache_dir={cache}",
                   "log.report=false"]
            with logs[n].open("w") as err:
                procs.append(subprocess.Popen(cmd, cwd=home, env=_env(), stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=err))
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                _reap(p, descendants(p.pid))
    errs = [log.read_text() for log in logs]
    # One `error:` line per node, no traceback (other lines: a fresh interpreter's import warnings, not the run's).
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for err in errs]
    for n in (0, 1):
        assert codes[n] == 2 and len(errors[n]) == 1 and "Traceback" not in errs[n], (n, codes[n], errs[n][-3000:])
    # Each node's line is the refusal (node 1's first rank says it too, rather than its launcher's rendezvous
    # error), naming rank 0's folder, absolute, and on node 1 its own.
    for n in (0, 1):
        here = f" (this node's is {homes[1] / 'run' / 'checkpoints'})" if n else ""
        assert errors[n][0] == (f"error: checkpoint folder {homes[0] / 'run' / 'checkpoints'}{here} is not shared by "
                                "every node: rank 1's node does not see the file rank 0 wrote there (1 node(s) in "
                                "all); put train.output_dir (or checkpoint.dir) on storage every node mounts at the "
                                "same path"), (n, errs[n][-3000:])
    # Nothing trained: no metrics, model or checkpoint; rank 0's marker removed (the run-dir lock may stay).
    assert {p.name for p in (homes[0] / "run").rglob("*")} - {".lock"} == {"checkpoints"}
    assert not (homes[1] / "run").exists()  # node 1's rank only looked


@pytest.mark.parametrize("nproc", [1, 2])
def test_every_minutes_saves_when_the_time_is_up(tmp_path, cache, nproc):
    """checkpoint.every_minutes: a save after each step once the time is up (here 1.2 ms: every step of the tiny
    run takes longer), rank 0's clock deciding on several processes; one process decides alone (no collective,
    no wait for the GPU's queue each step). every_steps off, so only the clock saves before the end."""
    out = tmp_path / "run"
    train(out, cache, "checkpoint.every_steps=0", "checkpoint.every_minutes=0.00002", "checkpoint.keep_last=20",
          "train.max_steps=4", nproc=nproc)
    saved = sorted(p.name for p in complete_checkpoints(out / "checkpoints"))
    assert saved == [f"step-{s:08d}" for s in range(1, 5)], saved
