"""Token-level causal LM loss, normalised over a whole optimizer step.

Gradient accumulation with a per-micro-batch mean weights short sequences too much (the
Trainer bug fixed by transformers PR #34191). shardtune returns the *sum* of token losses and
divides by the number of target tokens across all micro-batches and all ranks of the step, so
any split of the same global batch gives the same loss and gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over positions whose shifted label is not -100 (fp32)."""
    shift_logits = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the shift."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(rows whose every target token is the argmax, rows with any target token).

    Under teacher forcing, all-correct argmax is exactly what greedy decoding of the completion
    would produce, so this is the task's exact-match accuracy without a generate loop.
    """
    pred = logits[:, :-1, :].argmax(-1)
    target = labels[:, 1:].to(pred.device)
    mask = target != IGNORE_INDEX
    has_target = mask.any(dim=1)
    all_right = ((pred == target) | ~mask).all(dim=1) & has_target
    return int(all_right.sum()), int(has_target.sum())
