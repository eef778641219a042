"""FLOPs/MFU arithmetic, the LR schedule and the step-normalised loss."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardtune.config import OptimConfig
from shardtune.metrics.flops import flops_per_token, matmul_params, mfu, peak_flops
from shardtune.models.presets import preset_config
from shardtune.train.loss import count_target_tokens, exact_match, token_loss_sum
from shardtune.train.optim import lr_factor


def test_flops_per_token_formula():
    assert flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16


def test_llama_1b_flops_match_reference_mfu():
    # ../shared/device/README.md: HF Trainer + DeepSpeed ZeRO-2, 1.24 B shape, 40,475 tokens/s/GPU -> 33.6% MFU.
    cfg = preset_config("llama-3.2-1b")
    n = 1_235_814_400  # parameters of the Llama-3.2-1B shape (tied embeddings)
    fpt = flops_per_token(matmul_params(n, cfg), cfg.num_hidden_layers, cfg.hidden_size, 2048)
    assert mfu(40_475, fpt, 989e12) == pytest.approx(0.336, abs=0.002)


def test_untied_input_embedding_is_not_a_matmul():
    cfg = preset_config("llama-3-8b")
    assert matmul_params(8_030_261_248, cfg) == 8_030_261_248 - 128256 * 4096


def test_peak_table_lookup():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("cpu") is None
    assert mfu(1000.0, 1e9, None) is None


def test_schedule_warmup_then_cosine():
    opt = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, opt, 110) for s in range(110)]
    assert factors[0] == pytest.approx(1 / 11)
    assert max(factors) == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert lr_factor(110, opt, 110) == pytest.approx(0.1)
    assert lr_factor(50, OptimConfig(schedule="constant"), 100) == 1.0


def _toy(batch: int, seq: int, vocab: int, pad_from: list[int]):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    for row, start in enumerate(pad_from):
        labels[row, start:] = -100
    return logits, labels


def test_loss_normalised_by_step_tokens_not_per_micro_batch():
    # Two micro-batches with very different numbers of target tokens (the transformers #34191 case).
    a = _toy(2, 12, 7, [12, 12])
    b = _toy(2, 12, 7, [3, 2])
    whole_logits = torch.cat([a[0], b[0]])
    whole_labels = torch.cat([a[1], b[1]])
    n = count_target_tokens(whole_labels)
    assert n == count_target_tokens(a[1]) + count_target_tokens(b[1]) == 11 * 2 + 2 + 1
    accumulated = token_loss_sum(*a) / n + token_loss_sum(*b) / n
    reference = torch.nn.functional.cross_entropy(whole_logits[:, :-1].reshape(-1, 7), whole_labels[:, 1:].reshape(-1),
                                                  ignore_index=-100)
    assert accumulated.item() == pytest.approx(reference.item(), rel=1e-6)
    # The per-micro-batch mean (the old Trainer behaviour) gives a different, wrong answer here.
    naive = (token_loss_sum(*a) / count_target_tokens(a[1]) + token_loss_sum(*b) / count_target_tokens(b[1])) / 2
    assert abs(naive.item() - reference.item()) > 1e-3


def test_exact_match_counts_rows_with_all_targets_right():
    labels = torch.tensor([[5, 1, 2, -100], [5, 1, 2, 3], [5, -100, -100, -100]])
    logits = torch.zeros(3, 4, 8)
    # Row 0 predicts 1, 2 right; row 1 gets the last target wrong; row 2 has no targets.
    for row, preds in enumerate([[1, 2, 0], [1, 2, 4], [0, 0, 0]]):
        for t, p in enumerate(preds):
            logits[row, t, p] = 5.0
    assert exact_match(logits, labels) == (1, 2)
