"""The linear layer of a QLoRA base: dequantize the NF4 weight in one fused kernel, then matmul.

torchao's own NF4 linear (`F.linear` on an NF4Tensor) dequantizes with a chain of about twenty
eager ops in the weight's dtype: int64 code tensors, a gather from the code book, a materialised
copy of the expanded scales, a stack, then a cast to the activations' dtype. On an H200 that cost
~7 ms per 8B-shape projection and pass (forward, recompute, backward): QLoRA ran at 0.14x of
bitsandbytes (bench/RESULTS.md). Here the same arithmetic runs as one function of the NF4 data
tensors, compiled once per weight shape on CUDA (inductor fuses it into a kernel that reads the
half-byte codes and writes the weight in the compute dtype directly), and eager elsewhere.

The arithmetic is torchao's, in its order, in the NF4 weight's dtype, cast to the compute dtype
at the end: eager results equal `weight.get_original_weight().to(dtype)` bit for bit (tested).
The weight is dequantized again in backward (only the 4-bit weight is kept for it, never the
full-precision copy), like torchao's `LinearNF4` and bitsandbytes. Inside a compiled block (parallel.compile)
Inductor fuses the same arithmetic into the block's kernels, and its partitioner decides: with checkpointing the
backward dequantizes once more, without it (or under a memory budget over 0.7) the forward keeps every block's
compute-dtype weights for backward, as plan/memory.py `keeps_dequantised` prices (read on CPU).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NF4Linear", "nf4_dequantize", "nf4_inputs", "nf4_linear"]


def _dequantize(pairs: torch.Tensor, qscalers: torch.Tensor, qfactor: torch.Tensor, mean: torch.Tensor,
                code_book: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat dequantized weight from `pairs` (n_blocks, block_size / 2) of packed codes and
    `qscalers` (n_scaler_blocks, scaler_block_size). Only the leading dims vary between weights and
    are compiled as dynamic; the block sizes stay constants, so the kernel's index arithmetic never
    divides by a runtime value (a kernel that reshaped to a dynamic (rows, cols) ran 3x slower)."""
    # Second level first: int8 scalers / per-scaler-block factor + mean -> one scale per 64-value block
    # (torchao's NF4Tensor.dequantize_scalers).
    scales = (qscalers / qfactor.unsqueeze(-1)).flatten().to(mean.dtype) + mean
    # Each byte holds two consecutive values (high nibble first); a block's 64 values are 32 bytes.
    high = code_book[(pairs >> 4).long()] * scales.unsqueeze(-1)
    low = code_book[(pairs & 0b1111).long()] * scales.unsqueeze(-1)
    return torch.stack([high, low], dim=-1).flatten().to(dtype)


_compiled: Any = None


def _kernel(device: torch.device) -> Any:
    """The compiled dequantization on CUDA, eager elsewhere. SHARDTUNE_NF4_COMPILE=0 turns compiling
    off, =always compiles on any device (the CPU tests use it to run the compiled path)."""
    global _compiled
    mode = os.environ.get("SHARDTUNE_NF4_COMPILE", "1")
    if mode == "0" or (device.type != "cuda" and mode != "always"):
        return _dequantize
    if _compiled is None:
        _compiled = torch.compile(_dequantize, fullgraph=True)
    return _compiled


def nf4_inputs(weight: Any) -> tuple[torch.Tensor, ...]:
    """The NF4 data tensors of `weight`, shaped for `_dequantize`."""
    pairs = weight.quantized_data.view(-1, weight.block_size // 2)
    qscalers = weight.quantized_scalers.view(-1, weight.scaler_block_size)
    return pairs, qscalers, weight.quantization_factor, weight.scaler_mean, weight.nf4


def nf4_dequantize(weight: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full-precision weight of an (unsharded) NF4Tensor, in `dtype` (default the weight's)."""
    global _compiled
    pairs, qscalers, qfactor, mean, code_book = nf4_inputs(weight)
    args = (pairs, qscalers, qfactor, mean, code_book, dtype or weight.dtype)
    # Inside a compiled block Inductor fuses the plain arithmetic into the block's kernels. Reading the cache
    # there would make the block's graph guard on it: the first block traced fills it, so the graph traced
    # before that recompiled in step 2 (6 s of an 8B step on an H100, call 119).
    kernel = _dequantize if torch.compiler.is_compiling() else _kernel(pairs.device)
    if kernel is _dequantize:
        return _dequantize(*args).view(weight.shape)
    for t in (pairs, qscalers, qfactor):  # one kernel for every weight size: no recompile per shape
        # A hint, not a demand: a weight with one scaler block has its sizes specialised (a hard
        # mark_dynamic then fails the compile).
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        return kernel(*args).view(weight.shape)
    except Exception as err:  # no Triton / no compiler here: train on, slower, and say so once
        _compiled = _dequantize
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        warnings.warn(f"NF4: compiling the dequantization failed ({type(err).__name__}: {first[:200]}); using "
                      "the eager version (slower). SHARDTUNE_NF4_COMPILE=0 skips the attempt", stacklevel=2)
        return _dequantize(*args).view(weight.shape)


class _NF4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)  # the 4-bit weight (~1/8 of a bf16 copy), dequantized again below
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return F.linear(x.to(dtype), nf4_dequantize(weight, dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        (weight,) = ctx.saved_tensors
        grad_in = grad_out.to(ctx.dtype) @ nf4_dequantize(weight, ctx.dtype)
        return grad_in.to(ctx.x_dtype), None, None


def nf4_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a frozen NF4 weight, computed in the autocast dtype when
    autocast is on (the DDP path), else in the activations' dtype (FSDP2's mixed precision)."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    out = _NF4LinearFunction.apply(x, weight, dtype)
    return out if bias is None else out + bias.to(out.dtype)


class NF4Linear(nn.Linear):
    """An nn.Linear whose weight is a frozen NF4Tensor (`quantize_to_nf4` swaps the class in place;
    PEFT's LoRA layer still sees an nn.Linear base layer). Any other weight takes nn.Linear's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.weight).__name__ != "NF4Tensor":
            return super().forward(x)
        return nf4_linear(x, self.weight, self.bias)
