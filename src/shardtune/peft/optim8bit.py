"""8-bit AdamW for full fine-tuning under FSDP2: torchao's `AdamW8bit`.

Why torchao's and not bitsandbytes' `AdamW8bit`: torchao keeps each moment as a tensor subclass
(`OptimState8bit`: uint8 codes + one fp32 scale per 256-value block + the 256-entry code map)
created from the *local* shard of a DTensor parameter and wrapped back into a DTensor with the
parameter's placements, so states are sharded exactly like the parameters, and its subclass
implements what `DTensor.full_tensor()` and `torch.distributed.checkpoint` need (all-gather,
detach, copy_): checkpoints save, load and reshard like torch AdamW's (tested 2 -> 2 ranks,
bit-identical resume; 2 -> 1 checked by hand on one state). bitsandbytes' optimizer allocates
its states with `zeros_like(p)`, which under FSDP2 keeps the DTensor wrapper (global shape), and
hands the DTensor `p` and `p.grad` to its kernels, which read raw pointers: illegal memory
accesses (bitsandbytes #1633, open; the workarounds there patch both places to use the local
tensors). Not tried here: bitsandbytes is not a dependency.

Memory: 2 bytes of state per parameter (two uint8 moments), plus 8 bytes of scales per 256
parameters and a 1 KiB code map per state tensor, against 8 bytes for torch AdamW's fp32
moments. Shards smaller than 4096 values or not a multiple of the block size (norm weights,
biases) keep fp32 moments, as in bitsandbytes. The update is computed in fp32 from the
dequantized moments.

Compile: torchao compiles the per-parameter update with `torch.compile` (fullgraph, one graph per
distinct shape). On GPUs that is the fast path. On CPUs it needs a C++ toolchain and costs 9 s
(one process) to 20 s (two on 2 cores) of compiling before the first step, for ~3x faster steps
afterwards (tiny Llamas, torch 2.13 CPU). `compile="auto"` compiles on CUDA only and runs the
same update eagerly elsewhere (`torch.compiler.set_stance("force_eager")`: the same code).

The learning rate is a 0-d tensor in each param group (torchao's choice, so a compiled step does
not recompile when it changes); `torch.optim.lr_scheduler.LambdaLR` updates it in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # pure-Python parts only (see qlora.py)

__all__ = ["adamw8bit_available", "build_adamw8bit", "optimizer_state_bytes"]


def adamw8bit_available() -> bool:
    try:
        from torchao.optim import AdamW8bit  # noqa: F401
    except ImportError:
        return False
    return True


def build_adamw8bit(params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, *, block_size: int = 256,
                    compile: bool | str = "auto") -> torch.optim.Optimizer:
    """torchao's AdamW8bit over `params` (tensors or param-group dicts, e.g. per-group weight_decay),
    working with FSDP2's DTensor parameters on CPU and GPU.

    compile: "auto" (compile the update on CUDA, run it eagerly elsewhere), True or False.
    """
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        raise ImportError("8-bit AdamW needs torchao >= 0.16 (pip install -e '.[qlora]')") from err

    class ShardedAdamW8bit(AdamW8bit):
        """AdamW8bit whose update runs eagerly unless compiling was asked for (or auto on CUDA)."""

        def step(self, closure: Any = None) -> Any:
            if self._compiled:
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    params = list(params)
    opt = ShardedAdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size)
    if compile == "auto":
        devices = {p.device.type for g in opt.param_groups for p in g["params"]}
        opt._compiled = devices == {"cuda"}
    else:
        opt._compiled = bool(compile)
    return opt


def _local_bytes(t: Any) -> int:
    """Bytes a (possibly DTensor-wrapped, possibly quantized) state tensor holds on this process."""
    local = getattr(t, "_local_tensor", t)
    inner = getattr(local, "tensor_attrs", None)
    if inner:  # torchao OptimState8bit / 4bit / fp8: codes + scales (+ the shared code map)
        return sum(_local_bytes(getattr(local, name)) for name in inner)
    return local.numel() * local.element_size()


def optimizer_state_bytes(opt: torch.optim.Optimizer, *, per_param: bool = True) -> float:
    """Optimizer state bytes on this process (moments only; the step counters are left out), divided
    by the local number of parameter values when per_param (torch AdamW: 8.0; 8-bit AdamW: ~2.0)."""
    total, count = 0, 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            if not state:
                continue
            count += getattr(p, "_local_tensor", p).numel()
            total += sum(_local_bytes(v) for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor))
    return total / max(1, count) if per_param else float(total)
