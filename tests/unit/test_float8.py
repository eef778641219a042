"""train.float8: torchao's float8 training of the blocks' Linear layers. Its refusals, the conversion (which
layers, state dict unchanged), and a real run on one CPU process against bf16 (torch's CPU `_scaled_mm` is a slow
reference, so the micro model and a tiny batch). Speed is a GPU matter: bench/RESULTS.md."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MICRO, ROOT, one_line_error

from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.models.float8 import check_float8, convert_to_float8

pytest.importorskip("torchao")  # a dev dependency: installed in CI

TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["train.precision=fp32"], "set train.precision=bf16"),
    (["peft.method=qlora"], "NF4 already"),
    (["train.seq_len=25", "train.micro_batch_size=1"], "multiple of 16"),
])
def test_refused_where_it_cannot_run(overrides, message):
    cfg = load_config(TINY, ["train.float8=tensorwise", "train.precision=bf16", *overrides])
    with pytest.raises(ShardtuneError, match=message):
        check_float8(cfg, "cpu")
    check_float8(load_config(TINY, ["train.precision=bf16", *overrides]), "cpu")  # off: never refused


def test_bad_float8_settings_exit_2_in_one_line(cli):
    one_line_error(cli("validate", TINY, "train.float8=tensorwise", "train.precision=fp32"),
                   "train.float8: tensorwise trains in float8 from bf16 weights")
    one_line_error(cli("validate", TINY, "train.float8=rowwise", "parallel.backend=deepspeed"),
                   "train.float8 runs on parallel.backend=fsdp2")
    one_line_error(cli("validate", TINY, "train.float8=true"), "train.float8")


def test_deepspeed_refuses_it_in_one_line():
    from shardtune.validate import check_combination

    with pytest.raises(ShardtuneError, match=r"train.float8 runs on parallel.backend=fsdp2"):
        check_combination(load_config(TINY, ["train.float8=rowwise", "parallel.backend=deepspeed"]))
    check_combination(load_config(TINY, ["train.float8=rowwise"]))


def test_the_blocks_linear_layers_convert_and_the_state_dict_keeps_its_keys():
    from torchao.float8.float8_linear import Float8Linear
    from transformers import LlamaForCausalLM

    from shardtune.models.presets import preset_config

    with torch.device("meta"):
        model = LlamaForCausalLM(preset_config("micro-llama"))
    keys = list(model.state_dict())
    assert convert_to_float8(model, "rowwise") == 2 * 7  # q k v o gate up down in each of the 2 blocks
    assert not isinstance(model.lm_head, Float8Linear)
    assert list(model.state_dict()) == keys


def test_with_lora_only_the_frozen_base_layers_convert():
    from torchao.float8.float8_linear import Float8Linear
    from transformers import LlamaForCausalLM

    from shardtune.models.presets import preset_config
    from shardtune.peft.lora import apply_lora

    cfg = load_config(TINY, ["peft.method=lora", "peft.r=16"])
    with torch.device("meta"):
        model = apply_lora(LlamaForCausalLM(preset_config("micro-llama")), cfg.peft, "llama")
    keys = list(model.state_dict())
    converted = convert_to_float8(model, "tensorwise")
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == len(names) > 0 and all(n.endswith(".base_layer") for n in names)
    assert not any(isinstance(m, Float8Linear) for n, m in model.named_modules() if "lora_" in n)
    assert all(not m.weight.requires_grad for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert list(model.state_dict()) == keys


def _losses(out) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and not r.get("eval")]


def test_a_float8_run_trains_like_bf16_and_exports_a_plain_model(tmp_path, cli):
    from safetensors.torch import load_file

    runs = {}
    for mode in ("false", "tensorwise"):
        out = tmp_path / mode
        proc = cli("train", TINY, MICRO, "--nproc", "1", "--output-dir", str(out), "train.precision=bf16",
                   f"train.float8={mode}", "train.max_steps=4", "train.micro_batch_size=2", "log.every=1",
                   "train.eval_batches=1", "log.report=false", "train.lr=0.003")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = _losses(out)
    assert "float8 (tensorwise): 14 linear layers" in proc.stderr
    assert len(runs["tensorwise"]) == 4 and all(torch.isfinite(torch.tensor(runs["tensorwise"])))
    for a, b in zip(runs["false"], runs["tensorwise"], strict=True):
        assert b == pytest.approx(a, rel=0.05)  # float8's e4m3 rounding (~6%) on a few weights per output
    assert runs["tensorwise"] != runs["false"]  # it did run in float8
    got = load_file(str(tmp_path / "tensorwise" / "model" / "model.safetensors"))
    want = load_file(str(tmp_path / "false" / "model" / "model.safetensors"))
    assert got.keys() == want.keys()


def test_a_float8_lora_run_trains_like_bf16_lora_and_saves_its_adapter(tmp_path, cli):
    """LoRA with the frozen base layers in float8: close to bf16 LoRA; peft.base_dtype left to auto keeps them as
    their casts (made once, the bf16 weights freed) on one process: the same losses bit for bit as casting at every
    pass (peft.base_dtype=bf16), and a plain PEFT adapter either way."""
    runs = {}
    for mode, extra in (("false", []), ("tensorwise", ["peft.base_dtype=bf16"]), ("cached", [])):
        out = tmp_path / mode
        proc = cli("train", TINY, MICRO, "--nproc", "1", "--output-dir", str(out), "train.precision=bf16",
                   f"train.float8={'tensorwise' if mode == 'cached' else mode}", "peft.method=lora",
                   "train.max_steps=4", "train.micro_batch_size=2", "log.every=1", "train.eval_batches=1",
                   "log.report=false", "train.lr=0.01", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = _losses(out)
        kept = "float8 base: 14 frozen layers kept as their float8 casts" in proc.stderr
        assert kept == (mode == "cached"), proc.stderr[-3000:]
        if mode == "tensorwise":
            assert "float8 (tensorwise): 14 linear layers" in proc.stderr  # the base layers only
            # eager: the frozen weights' gradients for nothing; auto would keep the casts here
            assert "(set parallel.compile=true, or peft.base_dtype=auto)" in proc.stderr
    assert runs["tensorwise"] != runs["false"]
    for a, b in zip(runs["false"], runs["tensorwise"], strict=True):
        assert b == pytest.approx(a, rel=0.05)
    assert runs["cached"] == runs["tensorwise"]
    from safetensors.torch import load_file

    got, want = (load_file(str(tmp_path / mode / "adapter" / "adapter_model.safetensors"))
                 for mode in ("cached", "false"))
    assert got.keys() == want.keys() and any("lora_B" in k for k in got)  # a plain PEFT adapter
    assert all(got[k].abs().max() > 0 for k in got if "lora_B" in k)  # B starts at zero: it trained


@pytest.mark.parametrize("overrides, message", [
    (["peft.method=lora"], "set peft.method=lora and train.float8=tensorwise"),
    (["peft.method=lora", "train.float8=rowwise"], "set peft.method=lora and train.float8=tensorwise"),
    (["peft.method=none", "train.float8=tensorwise"], "set peft.method=lora and train.float8=tensorwise"),
    (["peft.method=lora", "train.float8=tensorwise", "parallel.strategy=ddp"], "whole on each GPU"),
    (["peft.method=lora", "train.float8=tensorwise", "peft.use_dora=true"], "DoRA"),
])
def test_a_float8_base_is_refused_where_it_cannot_be_kept(overrides, message, cli):
    from shardtune.validate import check_combination

    one_line_error(cli("validate", TINY, "--nproc", "1", "train.precision=bf16", "peft.base_dtype=float8",
                       *overrides), message)

    cfg = load_config(TINY, ["train.precision=bf16", "peft.base_dtype=float8", *overrides])
    with pytest.raises(ShardtuneError, match=message):
        check_combination(cfg, 1)
    sharded = load_config(TINY, ["train.precision=bf16", "peft.base_dtype=float8", "peft.method=lora",
                                 "train.float8=tensorwise"])
    check_combination(sharded, 1)  # one process: the base is whole
    with pytest.raises(ShardtuneError, match=r"parallel\.shard_frozen=false"):
        check_combination(sharded, 2)  # two: auto shards it
    check_combination(load_config(TINY, ["train.precision=bf16", "peft.base_dtype=float8", "peft.method=lora",
                                         "train.float8=tensorwise", "parallel.shard_frozen=false"]), 2)


ZERO3 = ["train.precision=bf16", "train.float8=tensorwise", "parallel.strategy=zero3", "train.max_steps=4",
         "train.micro_batch_size=2", "log.every=1", "train.eval_batches=1", "log.report=false", "train.lr=0.003"]


def _zero3(cli, out, nproc: int, *extra: str) -> list[float]:
    accum = 2 // nproc  # the same global batch: 2 x 1 against 1 x 2 accumulated
    proc = cli("train", TINY, MICRO, "--nproc", str(nproc), "--output-dir", str(out), *ZERO3,
               f"train.grad_accum={accum}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(out)


@pytest.fixture(scope="module")
def one_process_float8(tmp_path_factory) -> list[float]:
    from conftest import run_cli

    return _zero3(run_cli, tmp_path_factory.mktemp("float8_one"), 1)


@pytest.mark.parametrize("peft", ["none", "lora", "lora-float8-base"])
def test_float8_under_zero3_on_two_processes_matches_one(tmp_path, cli, peft, one_process_float8):
    """FSDP2 zero3 over 2 gloo processes gathers each bf16 weight (LoRA: the sharded frozen base) before torchao
    casts it, so float8's scales, and the losses, are one process's; so does a base kept whole on each process as
    its float8 casts (peft.base_dtype=float8, loaded layer by layer after FSDP2's set-up)."""
    want = one_process_float8 if peft == "none" else _zero3(cli, tmp_path / "one", 1, "peft.method=lora")
    extra = ["peft.base_dtype=float8", "parallel.shard_frozen=false"] if peft == "lora-float8-base" else []
    got = _zero3(cli, tmp_path / "two", 2, f"peft.method={peft[:4]}", *extra)
    assert len(got) == 4
    for a, b in zip(want, got, strict=True):
        assert b == pytest.approx(a, abs=1e-5)


def test_a_float8_checkpoint_of_two_processes_resumes_on_one(tmp_path, cli, one_process_float8):
    """The float8 layers keep nn.Linear's state dict, so a zero3 checkpoint of 2 processes resumes on 1 (DCP
    reshards it) and steps 3-4 are the uninterrupted run's."""
    out = tmp_path / "run"
    assert _zero3(cli, out, 2, "checkpoint.every_steps=2", "train.stop_after_step=2") == pytest.approx(
        one_process_float8[:2], abs=1e-5)
    resumed = _zero3(cli, out, 1, "--resume", "auto")
    assert len(resumed) == 4
    for a, b in zip(one_process_float8[2:], resumed[2:], strict=True):
        assert b == pytest.approx(a, abs=1e-5)


def test_precision_fp8_is_bf16_with_float8_matmuls(cli):
    assert (load_config(TINY, ["train.precision=fp8"]).train.float8, load_config(TINY, ["train.precision=fp8"])
            .train.precision) == ("tensorwise", "bf16")
    assert load_config(TINY, ["train.precision=fp8", "train.float8=rowwise"]).train.float8 == "rowwise"
    one_line_error(cli("validate", TINY, "train.precision=fp8", "train.float8=false"),
                   "train.precision: fp8 means bf16 with train.float8=tensorwise")


def test_cached_frozen_float8_weights_give_the_same_numbers_and_free_the_bf16_ones():
    """cache_frozen_weights: a LoRA model's frozen float8 base layers cast once give the per-call casts' loss and
    adapter gradients bit for bit, and the bf16 weights' storage is released (names and shapes stay)."""
    from transformers import LlamaForCausalLM

    from shardtune.models.float8 import cache_frozen_weights, frozen_float8_linear
    from shardtune.models.presets import preset_config
    from shardtune.peft.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(preset_config("micro-llama")), load_config(TINY, ["peft.method=lora"]).peft,
                       "llama").to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B starts at zero: give the base's input gradient a path
    convert_to_float8(model, "tensorwise")
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    keys = {k: v.shape for k, v in model.state_dict().items()}
    want_loss, want = loss_and_grads()
    assert cache_frozen_weights(model) == 14
    cached = [m for m in model.modules() if isinstance(m, frozen_float8_linear())]
    assert len(cached) == 14 and all(m.weight.untyped_storage().nbytes() == 0 for m in cached)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    got_loss, got = loss_and_grads()
    assert torch.equal(got_loss, want_loss)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_a_kept_float8_cast_skips_the_frozen_weight_s_gradient_matmul():
    """torchao's matmul forms the weight's gradient whatever the weight (compile drops it for a frozen one); the
    kept cast's layer runs only the forward and the input-gradient matmuls, eagerly too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardtune.models.float8 import cache_frozen_weights

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
            return func(*args, **(kwargs or {}))

    counts = {}
    for keep in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
        layer[0].weight.requires_grad_(False)
        convert_to_float8(layer, "tensorwise")
        if keep:
            assert cache_frozen_weights(layer) == 1
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        with CountMatmuls() as mode:
            layer(x).sum().backward()
        counts[keep] = mode.count
    assert counts == {False: 3, True: 2}, counts
