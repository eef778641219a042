"""parallel.one_gpu: direct with LoRA: the adapters' A and B matrices cast their fp32 weights in their forward
(CastLinear) instead of keeping a compute-dtype copy through the step. The same arithmetic as the copy, the
gradient lands in the fp32 master, and names and state dicts do not change."""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardtune.config import PeftConfig
from shardtune.dist import HostCopy
from shardtune.models.presets import preset_config
from shardtune.parallel.direct_engine import CastLinear, cast_adapters_in_forward
from shardtune.peft.lora import apply_lora


def _lora(**peft) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    model = apply_lora(model, PeftConfig(r=4, alpha=8, **peft), "llama")
    for name, p in model.named_parameters():  # B starts at zero: give it values so every path carries gradient
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # the frozen base in the compute dtype, the adapters fp32
    return model


def test_adapters_cast_in_their_forward_as_the_copy_computes():
    model = _lora()
    keys = list(model.state_dict())
    with_copies = copy.deepcopy(model)
    n = cast_adapters_in_forward(model, torch.bfloat16)
    matrices = [m for name, m in model.named_modules() if name.rsplit(".", 2)[-2:-1] in (["lora_A"], ["lora_B"])]
    assert n == len(matrices) > 0 and all(type(m) is CastLinear for m in matrices)
    assert list(model.state_dict()) == keys  # checkpoints and adapter exports keep their names
    assert all(p.dtype == torch.float32 for n_, p in model.named_parameters() if p.requires_grad)

    # The direct path's copy: bf16 adapter weights computed with, the gradient cast into the fp32 master.
    masters = {n_: p for n_, p in with_copies.named_parameters() if p.requires_grad}
    for p in masters.values():
        p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 16))
    got = model(input_ids=ids).logits.float()
    want = with_copies(input_ids=ids).logits.float()
    assert got.dtype == want.dtype and torch.equal(got, want)
    got.square().mean().backward()
    want.square().mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad, masters[name].grad.float()), name


def test_dora_keeps_the_copy():
    """DoRA's variant reads the matrices outside their forward, so they stay plain Linear (the engine's copy)."""
    model = _lora(use_dora=True)
    assert cast_adapters_in_forward(model, torch.bfloat16) == 0
    assert not any(isinstance(m, CastLinear) for m in model.modules())


def test_host_copy_reads_the_values_when_they_were_taken():
    t = torch.tensor(2.5)
    read = HostCopy(t, torch.tensor(True))
    t.add_(1.0)  # a later change is not seen: the values are copied when taken (on a GPU, queued then)
    assert read.values() == [2.5, 1.0]
