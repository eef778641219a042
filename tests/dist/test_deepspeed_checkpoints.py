"""DeepSpeed-format checkpoints from real runs: the pickle check, resume and the streaming export
(checkpoint/deepspeed_files.py). The pickle check on planted files is in tests/unit/test_deepspeed_files.py.

Real checkpoints come from one launch of 2 gloo processes (tests/dist/deepspeed_ckpt_worker.py), which
trains a small Llama (micro-llama) 2 steps through shardtune's DeepSpeedBackend per variant, writes a shardtune step
directory, and records what the backend held at save time (the logits of a fixed batch, every
trainable parameter). The export must give those logits back after a round trip through transformers
/ PEFT, and the fp32 master weights, not the bf16 module copies.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import MICRO, ROOT, Payload, run_cli, shardtune, torchrun

from shardtune.checkpoint.deepspeed_files import ALLOWED_GLOBALS, STATE_DIR, check_pickles, deepspeed_model_tensors
from shardtune.checkpoint.export import export_checkpoint
from shardtune.checkpoint.formats import stored_format
from shardtune.checkpoint.layout import _synced_file_info
from shardtune.errors import ShardtuneError

pytestmark = pytest.mark.dist

WORKER = str(ROOT / "tests" / "dist" / "deepspeed_ckpt_worker.py")
STEP = "checkpoints/step-00000002"
# -odd: odd tensor sizes (ZeRO pads its partitions) and an untied LM head.
VARIANTS = ["zero3-fp32-full", "zero2-fp32-full", "ddp-fp32-full", "zero3-fp32-full-odd", "zero2-fp32-full-odd",
            "zero3-bf16-full", "ddp-bf16-full", "zero3-fp32-lora", "ddp-fp32-lora", "zero1-bf16-lora"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("ds")
    torchrun(2, [WORKER, str(out), *VARIANTS], timeout=900)
    return out


def _reference(ckpts: Path, variant: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpts / variant / "reference.safetensors"))


def _batch() -> torch.Tensor:
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from deepspeed_ckpt_worker import fixed_batch

    return fixed_batch()


def _base_model():
    from shardtune.config import ModelConfig
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.models.weights import load_weights, make_source

    hf = preset_config("micro-llama")
    model = build_on_meta(hf)
    load_weights(model, make_source(ModelConfig(preset="micro-llama", seed=0), hf, torch.device("cpu")),
                 torch.device("cpu"))
    return model.eval()


def test_real_checkpoints_pass_the_pickle_check(ckpts):
    used: set[str] = set()
    for variant in VARIANTS:
        step = ckpts / variant / STEP
        assert stored_format(step) == "deepspeed"
        check_pickles(step / STATE_DIR)
        for f in (step / STATE_DIR).glob("*.pt"):
            used.update(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    assert used and used <= set(ALLOWED_GLOBALS)  # the allow-list is what they need, nothing the scan misses


def test_deepspeed_resumes_with_weights_only_reads(ckpts):
    """After one more step, the worker re-read every checkpoint through backend.load_native inside
    weights_only_loads (it asserts each torch.load had weights_only=True): the model came back as saved."""
    for variant in VARIANTS:
        ref = _reference(ckpts, variant)
        assert not torch.equal(ref["logits_moved"], ref["logits"]), variant  # the extra step changed the model
        assert torch.equal(ref["logits_reloaded"], ref["logits"]), variant


def test_payload_planted_in_a_real_checkpoint_stops_export(ckpts, tmp_path):
    step = tmp_path / "step"
    shutil.copytree(ckpts / "zero2-fp32-full" / STEP, step)
    marker = tmp_path / "ran"
    target = step / STATE_DIR / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": Payload(marker)}}, target)
    with pytest.raises(ShardtuneError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        deepspeed_model_tensors(step)
    # Whoever can plant a file can rewrite the manifest too: the command must still refuse it.
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][str(target.relative_to(step))] = _synced_file_info(target)  # size and checksum
    (step / "manifest.json").write_text(json.dumps(manifest))
    proc = shardtune("export", str(step), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in proc.stderr and "refusing to load it" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert not marker.exists()


@pytest.mark.parametrize("variant", ["zero3-fp32-full", "zero2-fp32-full", "ddp-fp32-full", "zero3-fp32-full-odd",
                                     "zero2-fp32-full-odd"])
def test_full_export_reloads_with_the_logits_at_save_time(ckpts, tmp_path, variant):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = _reference(ckpts, variant)
    out = tmp_path / "model"
    if variant == "zero3-fp32-full":  # the command line (in this process), several safetensors files
        proc = run_cli("export", str(ckpts / variant / STEP), str(out), "--max-shard-size", "200KB")
        assert proc.returncode == 0, proc.stderr[-3000:]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        files = sorted(out.glob("model-*.safetensors"))
    else:
        export_checkpoint(str(ckpts / variant / STEP), out)  # dtype auto: fp32 for an fp32 run
        files = [out / "model.safetensors"]
    saved = {k: v for f in files for k, v in load_file(str(f)).items()}
    # tied: saved once, as transformers does; untied: its own tensor
    assert ("lm_head.weight" in saved) == variant.endswith("-odd")
    params = {k: v for k, v in ref.items() if not k.startswith("logits")}
    assert set(saved) == set(params)
    for name, t in params.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], t), name
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=_batch()).logits
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["zero3-bf16-full", "ddp-bf16-full"])
def test_bf16_runs_export_the_fp32_masters(ckpts, tmp_path, variant):
    from safetensors.torch import load_file

    ref = {k: v for k, v in _reference(ckpts, variant).items() if not k.startswith("logits")}  # bf16 module copies
    export_checkpoint(str(ckpts / variant / STEP), tmp_path / "fp32", dtype="fp32")
    saved = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    finer = 0
    for name, module_copy in ref.items():
        assert module_copy.dtype == torch.bfloat16
        assert torch.equal(saved[name].to(torch.bfloat16), module_copy), name  # the master of that weight
        finer += not torch.equal(saved[name], module_copy.float())
    assert finer > len(ref) // 2  # fp32 values, not bf16 ones widened
    export_checkpoint(str(ckpts / variant / STEP), tmp_path / "auto")
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("variant", ["zero2-fp32-full", "zero3-bf16-full", "zero1-bf16-lora", "zero3-fp32-full-odd",
                                     "zero2-fp32-full-odd"])
def test_same_tensors_as_deepspeeds_own_consolidation(ckpts, variant):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    step = ckpts / variant / STEP
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(step / "deepspeed"), tag="state",
                                                      exclude_frozen_parameters=True)
    ours = deepspeed_model_tensors(step)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t.load(), theirs[name]), name


@pytest.mark.parametrize("variant", ["zero3-fp32-lora", "ddp-fp32-lora", "zero1-bf16-lora"])
def test_lora_adapter_export_reloads_through_peft(ckpts, tmp_path, variant):
    from peft import PeftModel
    from safetensors.torch import load_file

    ref = _reference(ckpts, variant)
    out = export_checkpoint(str(ckpts / variant / STEP), tmp_path / "adapter")
    state = load_file(str(out / "adapter_model.safetensors"))
    adapters = {k: v for k, v in ref.items() if not k.startswith("logits")}
    assert len(state) == len(adapters) > 0 and all(t.numel() for t in state.values())
    assert all(".lora_" in k and ".default." not in k for k in state)
    assert any(k.endswith("lora_B.weight") and t.abs().sum() > 0 for k, t in state.items())  # trained, not init
    for name, t in adapters.items():
        saved = state[name.replace(".default.weight", ".weight")]
        if t.dtype == torch.float32:
            assert torch.equal(saved, t), name
        else:  # bf16 run: the fp32 master of the bf16 adapter
            assert torch.equal(saved.to(t.dtype), t), name
    if ref["logits"].dtype == torch.float32 and "bf16" not in variant:
        model = PeftModel.from_pretrained(_base_model(), str(out)).eval()
        with torch.no_grad():
            logits = model(input_ids=_batch()).logits
        torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)


def test_merged_lora_export_of_a_deepspeed_checkpoint(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = _reference(ckpts, "zero3-fp32-lora")
    out = export_checkpoint(str(ckpts / "zero3-fp32-lora" / STEP), tmp_path / "merged", merge_lora=True)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=_batch()).logits
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)


def test_a_missing_rank_file_is_refused(ckpts, tmp_path):
    step = tmp_path / "step"
    shutil.copytree(ckpts / "zero3-fp32-full" / STEP, step)
    (step / STATE_DIR / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ShardtuneError, match="rank"):
        deepspeed_model_tensors(step)


def test_cli_train_then_export_a_deepspeed_lora_checkpoint(tmp_path, data_cache):
    """The real pipeline: `shardtune train` (deepspeed backend, zero2, bf16 LoRA, 2 processes) writes the
    checkpoint, `shardtune export` turns it into the adapter training saved at the end (in fp32 masters)."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = run_cli("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "2", "--output-dir", str(run),
                   MICRO, "parallel.backend=deepspeed", "parallel.strategy=zero2",
                   "train.precision=bf16", "peft.method=lora", "train.max_steps=3", "train.lr=1e-2",
                   "train.eval_batches=1", "log.progress=false", f"data.cache_dir={data_cache}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_cli("export", str(run), str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))  # the bf16 adapters, widened
    assert sorted(exported) == sorted(final) and final
    for name, t in final.items():
        assert torch.equal(exported[name].to(torch.bfloat16).float(), t), name
    assert any(not torch.equal(exported[n], final[n]) for n in final)  # finer than bf16: the masters


@pytest.mark.parametrize("variant", ["ddp-fp32-lora", "zero1-bf16-lora", "zero3-fp32-lora"])
def test_lora_checkpoints_hold_no_frozen_weights(ckpts, variant):
    # DeepSpeed's exclude_frozen_parameters misses the tied LM head (the frozen embedding under a
    # second name); shardtune drops every name of a frozen parameter, so only adapters are saved.
    from shardtune.checkpoint.deepspeed_files import load_file

    folder = ckpts / variant / STEP / "deepspeed" / "state"
    files = sorted(folder.glob("*model_states.pt"))
    assert files
    for path in files:
        module = load_file(path).get("module") or {}
        frozen = [k for k in module if ".lora_" not in k]
        assert not frozen, (path.name, frozen[:3])
    if not variant.startswith("zero3"):  # stages 0-2 keep the module state in mp_rank_00_model_states.pt
        assert any(".lora_" in k for k in load_file(folder / "mp_rank_00_model_states.pt")["module"])
