"""AdamW and the learning-rate schedule (linear warmup, then cosine / linear decay or constant)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.config import OptimConfig


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], optim: OptimConfig, lr: float,
                    device: torch.device, *, sharded_fp16: bool = False) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (1-D tensors) get no weight decay, as in HF Trainer."""
    groups = param_groups(named_params, optim.weight_decay)
    if optim.name == "adamw8bit":
        from shardtune.peft.optim8bit import build_adamw8bit

        return build_adamw8bit(groups, lr, optim.betas, optim.eps, optim.weight_decay)
    fused = use_fused(optim, device, sharded_fp16)
    # Unfused: foreach, not torch's default per-tensor Python loop (a DTensor op per tensor per update term).
    return torch.optim.AdamW(groups, lr=lr, betas=optim.betas, eps=optim.eps, fused=fused,
                             foreach=None if fused else True)


def use_fused(optim: OptimConfig, device: torch.device, sharded_fp16: bool) -> bool:
    """optim.fused: auto = the fused kernel (GPU and CPU: on a CPU, the tiny preset's step under FSDP2 takes 12 ms
    fused against 44 ms foreach, whose DTensor dispatch per op dominates), except for fp16 under FSDP2 sharding:
    there the sharded gradient scaler hands the optimizer a shape-[1] overflow flag, on which fused AdamW fails
    (`output with shape [] doesn't match the broadcast shape [1]`; found on an H200, reproduced on CPU), so
    foreach AdamW."""
    if optim.fused == "compiled":  # the direct path's own update; torch's AdamW keeps the state (foreach layout)
        return False
    if optim.fused == "auto":
        return device.type in ("cuda", "cpu") and not sharded_fp16
    return bool(optim.fused)


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Trainable parameters in two groups: matrices with weight decay, 1-D tensors (biases, norms) without."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            # A ZeRO-3 parameter is an empty placeholder between gathers; its real shape is ds_shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    return optim.warmup_steps or math.ceil(optim.warmup_ratio * total_steps)


def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier on the peak LR for optimizer step `step` (0-based)."""
    warm = warmup_steps(optim, total_steps)
    if step < warm:
        return (step + 1) / (warm + 1)
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * decay


def build_scheduler(opt: torch.optim.Optimizer, optim: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, optim, total_steps))


@dataclass(frozen=True)
class OptimizerFactory:
    """The run's optimizer, built by a backend over the parameters it holds once they are sharded (states
    then follow the shards): AdamW, or the 8-bit AdamW `optim.name` asks for, at peak LR `lr` (the loop's
    schedule scales it)."""

    optim: OptimConfig
    lr: float

    def __call__(self, named_params: Iterable[tuple[str, nn.Parameter]], device: torch.device, *,
                 sharded_fp16: bool = False, on_host: bool = False) -> torch.optim.Optimizer:
        """`sharded_fp16`: loss scaling through FSDP2's sharded scaler (see use_fused). `on_host`: the states
        live in host memory and are stepped there (DeepSpeed's offload)."""
        o = self.optim
        if on_host and device.type == "cuda":
            # DeepSpeed's vectorised CPU Adam (built on first use) steps host states faster than torch AdamW.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(param_groups(named_params, o.weight_decay), lr=self.lr, betas=o.betas,
                                    eps=o.eps, adamw_mode=True)
        # torch AdamW (fused on GPU); on a CPU-only machine also for offload, where states live on the host anyway.
        return build_optimizer(named_params, o, self.lr, torch.device("cpu") if on_host else device,
                               sharded_fp16=sharded_fp16)


def current_lr(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])  # a tensor for torchao's AdamW8bit
