"""Liger-Kernel (`pip install -e '.[liger]'`): Triton kernels for RMSNorm, RoPE and SwiGLU, swapped into the
model through Liger's own patching API, and its fused linear + cross-entropy, which never materialises the
[tokens, vocab] logits (2 GiB of bf16 at Llama-3's 128k vocabulary, micro-batch 4, seq 2048).

`model.liger`: false; true (the kernels and the fused loss, refused before start where they cannot
run); loss (the fused loss only, refused likewise); auto, the default (on when the run is on CUDA GPUs,
liger-kernel is installed and the model type is one below: the fused loss only under `parallel.compile`,
where Inductor fuses RMSNorm, RoPE and SwiGLU into the compiled blocks itself and Liger's kernels would only
cut those graphs, else the kernels and the loss).

shardtune computes its own loss (the sum of token losses, train/loss.py), so Liger's fused loss is not taken
through HF's forward (Liger's `lce_forward` averages). Instead `install_fused_loss` gives the causal-LM
module a forward that, when called with `labels`, runs the decoder and feeds its last hidden states and the
LM head's weight to `LigerFusedLinearCrossEntropyLoss(reduction="sum")`. It runs inside the root module's
forward, so under FSDP2 the root's pre-forward hook has already gathered the LM head (a plain, unsharded
tensor there, not a DTensor) and its backward hook reduce-scatters the gradient as for the plain path; a tied
LM head is the embedding, gathered the same way. Without `labels` (evaluation) the original forward runs and
returns logits.

On CPU (no Triton there) a reference loss of the same contract (reference_fused_loss) stands in for Liger's
kernel: the fused-loss forward gives the plain path's loss and gradients under FSDP2 and DeepSpeed stages 0-3; on
GPUs, tests/gpu and bench/RESULTS.md. Under DeepSpeed's ZeRO-3 the LM head's weight is an external parameter of
the loss's module (FusedLossHead), gathered for the loss and for its backward. When Liger applies (model types,
refusals, the choice) is in models/liger_rules.py, which imports no torch.
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


def backward_without_sync(grad_output: torch.Tensor, grad_input: torch.Tensor, grad_weight: torch.Tensor | None,
                          grad_bias: torch.Tensor | None) -> tuple[Any, Any, Any]:
    """Liger's `fused_linear_cross_entropy_backward` without its `torch.equal(grad_output, torch.tensor(1.0,
    device=...))` test: the test makes the host wait for the GPU twice at the start of every micro-batch's
    backward (a blocking copy of the 1.0, then the comparison read back), after which the whole backward is
    launched with the GPU's queue empty (bench/RESULTS.md, nineteenth session). shardtune's loss is divided by the
    step's token count, so grad_output is never 1.0 and Liger always ran the multiply: this runs the same launches
    of Liger's own `element_mul_kernel` (fp32 multiply inside the kernel; a torch `mul_` by a 0-d fp32 CUDA tensor
    would round the factor to bf16 first: bench/probe_scale_precision.py, call 61), without the test. Liger's
    module globals are read at call time, so its launch settings stay its own. Upstream removes the test in
    linkedin/Liger-Kernel PR #1292."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    cols = grad_input.shape[-1]
    block = min(flce.MAX_FUSED_SIZE, flce.triton.next_power_of_2(cols))
    warps = 32 if not flce.is_hip() else 16
    kernel = flce.element_mul_kernel
    kernel[(grad_input.shape[0],)](grad_input, grad_input.stride(-2), grad_output, cols, BLOCK_SIZE=block,
                                   X_col_stride=grad_input.stride(-1), num_warps=warps)
    if grad_weight is not None:
        kernel[(grad_weight.shape[0],)](grad_weight, grad_weight.stride(-2), grad_output, grad_weight.shape[1],
                                        BLOCK_SIZE=block, X_col_stride=grad_weight.stride(-1), num_warps=warps)
    if grad_bias is not None:
        kernel[(grad_bias.shape[0],)](grad_bias, grad_bias.stride(-1), grad_output, 1, BLOCK_SIZE=block,
                                      num_warps=warps)
    return grad_input, grad_weight, grad_bias


# Liger 0.8.5's helper: the launches backward_without_sync makes are these (tests/unit/test_liger.py).
_HELPER_ARGS = ["grad_output", "grad_input", "grad_weight", "grad_bias"]
REPLACED: list[Any] = []  # Liger's own helper, once swapped out (tests/gpu compares the two)


def skip_backward_sync() -> bool:
    """Put backward_without_sync where Liger's fused-loss autograd function looks its backward helper up (a module
    global of liger_kernel.ops.fused_linear_cross_entropy), only when the helper there is the one it stands for
    (the same arguments, the test still in it, and the kernel and settings it reads there); True when in place."""
    import inspect

    from liger_kernel.ops import fused_linear_cross_entropy as flce

    current = getattr(flce, "fused_linear_cross_entropy_backward", None)
    if current is backward_without_sync:
        return True
    if current is None or list(inspect.signature(current).parameters) != _HELPER_ARGS:
        return False
    source = inspect.getsource(current)
    if "torch.equal" not in source or source.count("element_mul_kernel[") != 3 or not all(
            hasattr(flce, name) for name in ("element_mul_kernel", "MAX_FUSED_SIZE", "is_hip", "triton")):
        return False
    REPLACED[:] = [current]
    flce.fused_linear_cross_entropy_backward = backward_without_sync
    return True


def liger_loss(chunk: int = 0, accum: str = "weight") -> Any:
    """Liger's fused linear + cross-entropy, summing token losses (accumulated in fp32) as train/loss.py does,
    its logits made `chunk` tokens at a time (`model.liger_chunk`, through Liger's chunk_mem_const; 0 or a Liger
    without that argument: Liger's own chunk), the LM head's gradient summed over the chunks in `accum`
    (`model.liger_accum`: accum_dtype)."""
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from shardtune.models.liger_rules import fused_loss_chunk

    sized = chunk > 0 and "chunk_mem_const" in inspect.signature(liger_fused_linear_cross_entropy).parameters
    skip_backward_sync()

    def loss(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        extra = {}
        if sized:
            extra["chunk_mem_const"] = fused_loss_chunk(hidden.size(0), weight.size(0), weight.size(1), chunk)[0]
        return liger_fused_linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                                                reduction="sum", accum_dtype=accum_dtype(accum), **extra)

    return loss


def accum_dtype(accum: str) -> torch.dtype | None:
    """Liger's accum_dtype for model.liger_accum: fp32, or None (the weight's own dtype: Liger's default)."""
    return torch.float32 if accum == "fp32" else None


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


class FusedLossHead(nn.Module):
    """The fused loss as a module of the model, with no parameter of its own. DeepSpeed's ZeRO-3 gathers a
    module's weights around its forward and again around its backward; the fused loss reads the LM head's weight
    without calling the head, so the DeepSpeed backend registers that weight as this module's external parameter
    (`deepspeed.zero.register_external_parameter`, the API for a weight read outside its owner's forward): gathered
    for the loss, and again when the loss's gradient reaches the module, so the weight's gradient is accumulated
    into a whole parameter. Elsewhere it is a plain call."""

    def __init__(self, causal_lm: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self._owner = [causal_lm]  # a reference, not a submodule: the head stays the model's in the state dict

    @property
    def weight(self) -> nn.Parameter:
        """The LM head's weight, read at each call (a tied head is the embedding's)."""
        return self._owner[0].lm_head.weight

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.weight, hidden, targets)


def install_fused_loss(causal_lm: nn.Module, loss_fn: Any) -> None:
    """Give `causal_lm` a forward that, called with `labels`, returns FusedLossOutput(loss=sum of next-token
    losses) from `loss_fn(lm_head_weight, hidden [N, H], shifted_targets [N])`, never the logits; without
    labels it is the original forward. The labels are shifted, not the hidden states, so no copy of them. The
    loss runs in the submodule `fused_loss_head` (FusedLossHead)."""
    original = causal_lm.forward
    causal_lm.fused_loss_head = FusedLossHead(causal_lm, loss_fn)

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(*args, **kwargs)
        hidden = self.model(*args, **kwargs).last_hidden_state
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(hidden.device)
        loss = self.fused_loss_head(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))
        return FusedLossOutput(loss=loss.float())

    causal_lm.forward = MethodType(forward, causal_lm)
