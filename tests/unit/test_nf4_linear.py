"""The fused NF4 linear (peft/nf4_linear.py) against torchao's own dequantization and linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.peft.nf4_linear import NF4Linear, nf4_dequantize, nf4_linear
from shardtune.peft.qlora import nf4_available, quantize_to_nf4

if not nf4_available():
    pytest.skip("torchao is not installed (pip install '.[qlora]')", allow_module_level=True)

from torchao.quantization import to_nf4


def weight(rows: int, cols: int, dtype: torch.dtype, seed: int = 0, sbs: int = 128):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return to_nf4(w, 64, sbs)


@pytest.mark.parametrize("nf4_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_torchaos_bit_for_bit(nf4_dtype, out_dtype):
    w = weight(96, 128, nf4_dtype, sbs=64)
    assert torch.equal(nf4_dequantize(w, out_dtype), w.get_original_weight().to(out_dtype))


def test_linear_forward_and_input_grad_equal_torchaos():
    w = weight(64, 128, torch.float32, seed=1)
    x = torch.randn(3, 5, 128, requires_grad=True, generator=torch.Generator().manual_seed(2))
    ref_x = x.detach().clone().requires_grad_(True)
    out = nf4_linear(x, w)
    ref = torch.nn.functional.linear(ref_x, w)  # torchao's LinearNF4, through NF4Tensor.__torch_function__
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, ref_x.grad)


def test_autocast_computes_in_bf16_and_returns_fp32_input_grads():
    w = weight(64, 128, torch.float32, seed=3)
    x = torch.randn(4, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nf4_linear(x, w)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32
    expected = x.detach().bfloat16() @ w.get_original_weight().bfloat16().t()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_quantize_swaps_plain_linears_to_nf4linear_with_bias():
    model = nn.Sequential(nn.Linear(128, 64, bias=True), nn.ReLU(), nn.Linear(64, 128, bias=False))
    x = torch.randn(2, 128)
    quantize_to_nf4(model, lambda name: name in {"0", "2"})
    assert type(model[0]) is NF4Linear and type(model[2]) is NF4Linear
    first = x @ model[0].weight.get_original_weight().t() + model[0].bias
    expected = torch.relu(first) @ model[2].weight.get_original_weight().t()
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)


@pytest.fixture
def compiled_kernel(monkeypatch):
    """The CUDA path (the dequantization compiled, sizes dynamic) on this CPU: inductor's CPU backend."""
    import shardtune.peft.nf4_linear as nl

    monkeypatch.setenv("SHARDTUNE_NF4_COMPILE", "always")
    monkeypatch.setattr(nl, "_compiled", None)
    try:
        torch.compile(lambda t: t + 1)(torch.ones(2))
    except Exception as err:  # no C++ compiler for inductor's CPU backend
        pytest.skip(f"inductor cannot compile on this machine: {type(err).__name__}")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_dequantize_equals_eager_for_several_sizes_in_one_graph(compiled_kernel):
    from torch._dynamo.utils import counters

    counters.clear()
    for seed, (rows, cols) in enumerate([(128, 256), (64, 512), (256, 128)]):
        w = weight(rows, cols, torch.float32, seed=seed, sbs=64)
        assert torch.equal(nf4_dequantize(w, torch.bfloat16), w.get_original_weight().to(torch.bfloat16))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one kernel for all sizes


def _tiny_qlora_model(compile_blocks: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    # 64 x 64 projections: one scaler block each, so their sizes are specialised by the compiler
    quantize_to_nf4(model, lambda n: n.endswith(".base_layer"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, 0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    if compile_blocks:  # parallel.compile: each decoder block compiled, the kernel's compile nested in it
        for layer in model.base_model.model.model.layers:
            layer.compile()
    return model


def _step(model):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _tiny_qlora(compile_blocks: bool):
    return _step(_tiny_qlora_model(compile_blocks))


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_compiled_kernel_in_a_qlora_model_gives_the_eager_loss_and_grads(compiled_kernel, compile_blocks):
    import os

    loss, grads = _tiny_qlora(compile_blocks)
    os.environ["SHARDTUNE_NF4_COMPILE"] = "0"  # the reference: eager dequantization (restored by monkeypatch)
    ref_loss, ref_grads = _tiny_qlora(False)
    assert abs(loss - ref_loss) < 1e-6
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    import shardtune.peft.nf4_linear as nl

    def broken(*args):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setenv("SHARDTUNE_NF4_COMPILE", "always")
    monkeypatch.setattr(nl, "_compiled", broken)
    w = weight(64, 128, torch.float32, seed=7)
    with pytest.warns(UserWarning, match="NF4: compiling the dequantization failed .*triton"):
        first = nf4_dequantize(w, torch.bfloat16)
    assert torch.equal(first, w.get_original_weight().to(torch.bfloat16))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the eager kernel is used from now on
        assert torch.equal(nf4_dequantize(w, torch.bfloat16), first)


def test_compiled_blocks_do_not_recompile_after_the_first_step(compiled_kernel):
    """Call 119 (8B QLoRA on an H100): step 2 took 6 s more than step 3, one block recompiled there because its
    first graph guarded on the module's `_compiled` cache, which tracing the first block had filled."""
    from torch._dynamo.utils import counters

    model = _tiny_qlora_model(True)
    counters.clear()
    _step(model)
    first = dict(counters["stats"])
    _step(model)  # the same blocks and shapes: every graph is reused
    assert dict(counters["stats"]) == first
