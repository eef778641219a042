"""optim.weight_decay is not applied to biases and norm weights (README's config reference): checked on the
optimizer a backend builds (OptimizerFactory) by what one AdamW step does to the weights, not by restating the rule.

With every gradient zero, AdamW's Adam term is 0 / (sqrt(0) + eps) = 0, so a step only applies decoupled weight
decay: a decayed tensor becomes p * (1 - lr * wd), an undecayed one stays as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from shardtune.assemble import assemble
from shardtune.config import ModelConfig, OptimConfig, PeftConfig
from shardtune.models.weights import load_weights
from shardtune.train.optim import OptimizerFactory

CPU = torch.device("cpu")
LR, WD = 0.1, 0.5
# Qwen2: biases on q/k/v (Llama has none), RMSNorm weights, untied embedding and LM head.
QWEN2 = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)


def _loaded(peft: PeftConfig) -> torch.nn.Module:
    built = assemble(ModelConfig(preset="tiny-llama"), peft, "fp32", QWEN2, CPU, 1)
    load_weights(built.model, built.source, CPU)
    with torch.no_grad():  # biases start at zero, where decay shows nothing; LoRA's B too
        for name, p in built.model.named_parameters():
            if name.endswith("bias") or "lora_B" in name:
                p.fill_(1.0)
    return built.model


def _decay_step(model: torch.nn.Module, name: str = "adamw") -> dict[str, float]:
    """Each trainable parameter's factor p_after / p_before over one step with zero gradients."""
    opt = OptimizerFactory(OptimConfig(name=name, weight_decay=WD), LR)(model.named_parameters(), CPU)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    factors = {}
    for n, p in params.items():
        ratio = p.detach()[before[n] != 0] / before[n][before[n] != 0]
        assert torch.allclose(ratio, ratio[0], atol=1e-3), n  # one factor for the whole tensor
        factors[n] = float(ratio.mean())
    return factors


def _is_bias_or_norm(name: str) -> bool:
    return name.endswith("bias") or "norm" in name


def test_weight_decay_skips_biases_and_norm_weights():
    factors = _decay_step(_loaded(PeftConfig()))
    biases = [n for n in factors if n.endswith("bias")]
    norms = [n for n in factors if "norm" in n]
    assert len(biases) == 3 * QWEN2.num_hidden_layers and len(norms) == 2 * QWEN2.num_hidden_layers + 1
    for name, factor in factors.items():
        # Matrices (projections, the embedding and the LM head, as in HF Trainer) decay; biases and norms do not.
        expected = 1.0 if _is_bias_or_norm(name) else 1 - LR * WD
        assert factor == pytest.approx(expected, abs=1e-5), name


def test_weight_decay_with_lora_applies_to_the_adapter_matrices():
    model = _loaded(PeftConfig(method="lora", r=4, alpha=8))
    factors = _decay_step(model)
    assert factors and all(".lora_" in n for n in factors)  # the frozen base is not in the optimizer
    assert all(f == pytest.approx(1 - LR * WD, abs=1e-5) for f in factors.values())


def test_adamw8bit_keeps_the_same_groups():
    pytest.importorskip("torchao")
    model = _loaded(PeftConfig())
    opt = OptimizerFactory(OptimConfig(name="adamw8bit", weight_decay=WD), LR)(model.named_parameters(), CPU)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            assert group["weight_decay"] == (0.0 if _is_bias_or_norm(by_id[id(p)]) else WD), by_id[id(p)]
