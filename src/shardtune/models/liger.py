"""Liger-Kernel (`pip install -e '.[liger]'`): Triton kernels for RMSNorm, RoPE and SwiGLU, swapped into the
model through Liger's own patching API, and its fused linear + cross-entropy, which never materialises the
[tokens, vocab] logits (2 GiB of bf16 at Llama-3's 128k vocabulary, micro-batch 4, seq 2048).

`model.liger`: false (default); true (the kernels and the fused loss, refused before start where they cannot
run); loss (the fused loss only, refused likewise); auto (on when the run is on CUDA GPUs, liger-kernel is
installed and the model type is one below: the fused loss only under `parallel.compile`, where Inductor fuses
RMSNorm, RoPE and SwiGLU into the compiled blocks itself and Liger's kernels would only cut those graphs,
else the kernels and the loss).

shardtune computes its own loss (the sum of token losses, train/loss.py), so Liger's fused loss is not taken
through HF's forward (Liger's `lce_forward` averages). Instead `install_fused_loss` gives the causal-LM
module a forward that, when called with `labels`, runs the decoder and feeds its last hidden states and the
LM head's weight to `LigerFusedLinearCrossEntropyLoss(reduction="sum")`. It runs inside the root module's
forward, so under FSDP2 the root's pre-forward hook has already gathered the LM head (a plain, unsharded
tensor there, not a DTensor) and its backward hook reduce-scatters the gradient as for the plain path; a tied
LM head is the embedding, gathered the same way. Without `labels` (evaluation) the original forward runs and
returns logits.

Measured on CPU only (no Triton there): the key, the refusals, and that the fused-loss forward gives the
plain path's loss and gradients with a reference loss of the same contract, also under FSDP2. Not yet measured
on a GPU: Liger's kernels inside shardtune (speed, memory, loss parity against the plain path), with
torch.compile'd blocks, with packing (position_ids go through Liger's RoPE unchanged), and with PEFT.
The DeepSpeed backend gets the kernels but keeps the plain loss (ZeRO-3 gathers the LM head only when the
module itself is called). When Liger applies (model types, refusals, the choice) is in models/liger_rules.py,
which imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.data import IGNORE_INDEX


def apply_liger_kernels(causal_lm: nn.Module) -> None:
    """Swap Liger's RMSNorm, RoPE and SwiGLU into `causal_lm` (the HF model under any adapters, on meta before
    sharding and compile), through Liger's own instance patching. Its fused loss is installed separately."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=causal_lm, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def liger_loss(chunk: int = 0) -> Any:
    """Liger's fused linear + cross-entropy, summing token losses (accumulated in fp32) as train/loss.py does,
    its logits made `chunk` tokens at a time (`model.liger_chunk`, through Liger's chunk_mem_const; 0 or a Liger
    without that argument: Liger's own chunk)."""
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from shardtune.models.liger_rules import fused_loss_chunk

    sized = chunk > 0 and "chunk_mem_const" in inspect.signature(liger_fused_linear_cross_entropy).parameters

    def loss(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        extra = {}
        if sized:
            extra["chunk_mem_const"] = fused_loss_chunk(hidden.size(0), weight.size(0), weight.size(1), chunk)[0]
        return liger_fused_linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                                                reduction="sum", accum_dtype=torch.float32, **extra)

    return loss


def reference_fused_loss(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What liger_loss computes, in plain torch (materialising the logits): the contract the fused path is
    tested against on machines without Triton."""
    return F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass
class FusedLossOutput:
    loss: torch.Tensor  # the sum of next-token losses of the batch (fp32), as token_loss_sum returns


# A pytree node, so FSDP2 finds the loss in the root's output and hooks its pre-backward there: that hook
# gathers the root's parameters (embedding, final norm, LM head) again for backward after zero3 resharded them.
# Without it (torch 2.11's FSDP2 flattens outputs with pytree, and a plain dataclass is a leaf) the final
# norm's backward read freed memory: an illegal memory access on the GPU with LoRA under zero3 (bench/RESULTS.md
# 2026-12-02).
torch.utils._pytree.register_dataclass(FusedLossOutput)


def install_fused_loss(causal_lm: nn.Module, loss_fn: Any) -> None:
    """Give `causal_lm` a forward that, called with `labels`, returns FusedLossOutput(loss=sum of next-token
    losses) from `loss_fn(lm_head_weight, hidden [N, H], shifted_targets [N])`, never the logits; without
    labels it is the original forward. The labels are shifted, not the hidden states, so no copy of them."""
    original = causal_lm.forward

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(*args, **kwargs)
        hidden = self.model(*args, **kwargs).last_hidden_state
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(hidden.device)
        loss = loss_fn(self.lm_head.weight, hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))
        return FusedLossOutput(loss=loss.float())

    causal_lm.forward = MethodType(forward, causal_lm)
