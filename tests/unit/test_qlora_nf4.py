"""QLoRA base weights in one process: NF4 quantization of a tiny Llama's linears, PEFT LoRA on top.

Tolerances: NF4 has 16 levels per 64-value block scaled by the block's absmax; the widest gap
between levels is 0.3038 of the absmax, so no value moves by more than 0.152 x absmax, plus the
8-bit error of the double-quantized scale: we allow 0.16 x absmax per block and a relative
Frobenius error under 0.10 (measured 0.09 on Gaussian weights). bf16 compute against fp32: 3e-2
on logits of magnitude ~1.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shardtune.config import ParallelConfig
from shardtune.parallel.prepare import checkpoint_and_compile
from shardtune.peft.qlora import (
    is_nf4,
    load_nf4_rows,
    nf4_available,
    nf4_bytes,
    nf4_full_weight,
    nf4_scaler_block_size,
    nf4_unmaterialised,
    quantize_to_nf4,
)

pytest.importorskip("peft")
if not nf4_available():
    pytest.skip("torchao is not installed (pip install '.[qlora]')", allow_module_level=True)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def with_lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))


@pytest.fixture(scope="module")
def qlora():
    model = with_lora(tiny_llama())
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("base_layer.weight")}
    names = quantize_to_nf4(model, lambda n: n.endswith(".base_layer"))
    return model, originals, names


def test_targets_become_frozen_nf4(qlora):
    model, originals, names = qlora
    assert len(names) == 2 * len(TARGETS) == len(originals)
    params = dict(model.named_parameters())
    for name in originals:
        assert is_nf4(params[name]) and not params[name].requires_grad, name
    # nothing else was touched: embeddings, norms, lm_head and the adapters stay plain fp32
    others = [n for n, p in params.items() if n not in originals]
    assert others and not any(is_nf4(params[n]) for n in others)
    assert all(params[n].dtype == torch.float32 for n in others)


def test_dequantized_close_to_originals(qlora):
    model, originals, _ = qlora
    params = dict(model.named_parameters())
    for name, w in originals.items():
        deq = params[name].get_original_weight()
        assert deq.shape == w.shape and deq.dtype == w.dtype
        err = (deq - w).reshape(-1, 64).abs().amax(1)
        absmax = w.reshape(-1, 64).abs().amax(1)
        assert bool((err <= 0.16 * absmax).all()), name
        assert float((deq - w).norm() / w.norm()) < 0.10, name


def test_nf4_memory_is_half_a_byte_per_parameter(qlora):
    model, originals, _ = qlora
    params = dict(model.named_parameters())
    for name in originals:
        p = params[name]
        sbs = p.scaler_block_size
        # 4-bit codes + an int8 scale per 64 values + an fp32 factor per 64*sbs values + mean + 16-entry code book
        expected = p.numel() // 2 + p.numel() // 64 + 4 * (p.numel() // (64 * sbs)) + 4 + 16 * 4
        assert nf4_bytes(p) == expected
    n = sum(params[k].numel() for k in originals)
    per_param = sum(nf4_bytes(params[k]) for k in originals) / n
    assert 0.5 < per_param < 0.56, per_param  # vs 4.0 for the fp32 weights


def test_forward_backward_fp32_lora_grads_only(qlora):
    model, _, _ = qlora
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        if is_nf4(p):
            assert p.grad is None, name
        elif "lora_" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name  # PEFT froze the rest
    assert any(float(p.grad.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_peft_lora_layer_dispatches_to_nf4_linear(qlora):
    from peft.tuners.lora import Linear as LoraLinear

    model, _, _ = qlora
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    # NF4Tensor is no TorchAOBaseTensor: PEFT's plain LoRA linear wraps it (not TorchaoLoraLinear)
    assert type(layer) is LoraLinear and is_nf4(layer.base_layer.weight)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)
        x = torch.randn(3, 64)
        expected = x @ layer.base_layer.weight.get_original_weight().t() + \
            layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
        got = layer(x)
        layer.lora_B["default"].weight.zero_()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_compute_like_fsdp2_mixed_precision(qlora):
    """FSDP2's bf16 policy casts every ordinary parameter to bf16 and leaves NF4 alone; NF4's
    linear then dequantizes to the activations' dtype. Also torch.autocast (the DDP path)."""
    model, _, _ = qlora
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(input_ids=ids).logits
    model.zero_grad(set_to_none=True)
    saved = {}
    for name, p in model.named_parameters():
        if not is_nf4(p):
            saved[name] = p.data
            p.data = p.data.to(torch.bfloat16)
    try:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert out.logits.dtype == torch.bfloat16
        grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
        bad = [n for n, g in grads.items() if g is None or g.dtype != torch.bfloat16 or not torch.isfinite(g).all()]
        assert not bad, bad
    finally:
        for name, p in model.named_parameters():
            if name in saved:
                p.data, p.grad = saved[name], None
    torch.testing.assert_close(out.logits.float(), ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(auto.float(), ref, rtol=0, atol=3e-2)


def test_quantize_before_peft_wraps_nf4_linear():
    model = tiny_llama()
    names = quantize_to_nf4(model, lambda n: n.rsplit(".", 1)[-1] in TARGETS)
    assert len(names) == 14
    model = with_lora(model)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    assert is_nf4(layer.base_layer.weight)
    ids = torch.randint(0, 256, (1, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_activation_checkpointing_gives_the_same_gradients():
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = with_lora(tiny_llama())
        quantize_to_nf4(model, lambda n: n.endswith(".base_layer"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, 0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        if checkpointing:  # as a run checkpoints each block (prepare.CheckpointedForward)
            blocks = list(model.base_model.model.model.layers)
            checkpoint_and_compile(model, blocks, ParallelConfig(activation_checkpointing="full"))
        model.train()
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys() and any("lora_A" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-6)


def test_meta_skeleton_then_row_loading_matches_whole_quantization():
    """The sharded path in one process: an NF4 skeleton on meta, materialised with to_empty, filled by
    load_nf4_rows: the same codes and scales as quantizing the whole weight at once."""
    from shardtune.peft.qlora import _nf4_api

    _, to_nf4 = _nf4_api()
    full = torch.randn(128, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    with torch.device("meta"):
        lin = nn.Linear(64, 128, bias=False)
    assert quantize_to_nf4(lin, lambda n: True, scaler_block_size=32) == [""]
    assert lin.weight.is_meta and is_nf4(lin.weight)
    lin.to_empty(device="cpu")
    assert nf4_unmaterialised(lin) == ["weight"]  # to_empty leaves the mean and code book on meta
    load_nf4_rows(lin.weight, full)
    assert nf4_unmaterialised(lin) == []
    whole = to_nf4(full, 64, 32)
    assert torch.equal(lin.weight.quantized_data, whole.quantized_data)
    assert torch.equal(lin.weight.quantized_scalers, whole.quantized_scalers)
    torch.testing.assert_close(nf4_full_weight(lin.weight), whole.get_original_weight(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="shape"):
        load_nf4_rows(lin.weight, full[:64])


def test_scaler_block_size_fits_the_shards():
    assert nf4_scaler_block_size((4096, 4096), 8) == 256
    assert nf4_scaler_block_size((1024, 4096), 8) == 256  # Llama-3-8B k_proj on 8 ranks
    assert nf4_scaler_block_size((128, 896), 2) == 128  # Qwen2.5-0.5B k_proj on 2 ranks
    assert nf4_scaler_block_size((32, 64), 2) == 16
    assert nf4_scaler_block_size((3, 64), 2) is None  # rows do not split evenly
    assert nf4_scaler_block_size((2, 48), 1) is None  # not whole 64-value blocks
    assert nf4_scaler_block_size((4, 4, 64)) is None


def test_unshardable_linear_is_left_alone_with_a_warning():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = quantize_to_nf4(model, lambda n: True, shard_world=2)
    assert names == ["0"]
    assert is_nf4(model[0].weight) and not is_nf4(model[1].weight)
    assert model[0].bias is not None and not is_nf4(model[0].bias)
    assert any("left in full precision" in str(w.message) for w in caught)
