"""`optim.fused: compiled` on the one-GPU direct path: the step's gradient norm, clipping, non-finite skip, AdamW
update and the cast of each updated master to the model's compute-dtype copy, in one torch.compile'd function.

Why: the direct path's update otherwise streams the weights four times (1B shape on one H200, call 57's profile,
per 127 ms step): each bf16 gradient cast into an fp32 master gradient in backward (4.7 ms), the norm over those
(1.4), fused AdamW reading fp32 p, g, m, v and writing p, m, v (11.8), and the masters cast back into the compute
copies (2.1). Compiled together the gradient is read in bf16 for the norm and again inside the update, which writes
the copy as it writes the master: 30 bytes a parameter (2 + 2 + 12 read, 12 + 2 written) instead of 44 (the cast 6,
the norm 4, AdamW 28, the cast back 6), and the fp32 gradients (4 bytes a parameter, 4.6 GiB at 1B) are never
made. The arithmetic is AdamW's in the order of torch's fused CUDA kernel (fused_adam_utils.cuh, ADAMW mode),
clipping as GradScaler's `grad_scale` divisor and the skip as its `found_inf`; the state stays torch.optim.AdamW's
(exp_avg, exp_avg_sq, step), so checkpoints resume under either update.
"""

from __future__ import annotations

from typing import Any

import torch


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor | None], step: torch.Tensor,
                 lrs: torch.Tensor, hyper: tuple[tuple[int, float, float, float, float], ...],
                 max_grad_norm: float, skip_nonfinite: bool) -> torch.Tensor:
    """One AdamW step over every trainable master, in place; returns the gradient norm (before clipping).
    `hyper[i]`: (index of param i's group in `lrs`, weight decay, beta1, beta2, eps). `step`: the steps taken so
    far (a 0-dim fp32 tensor, advanced unless the step is skipped). `copies[i]`: the compute-dtype tensor the
    model computes with, written from the updated master (None where the model computes with the master)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    keep = torch.isfinite(norm) if skip_nonfinite else torch.ones((), dtype=torch.bool, device=norm.device)
    divisor = (norm + 1e-6).div(max_grad_norm).clamp(min=1.0) if max_grad_norm > 0 else torch.ones_like(norm)
    taken = step + 1
    for p, g, m, v, copy, (group, decay, beta1, beta2, eps) in zip(params, grads, exp_avgs, exp_avg_sqs, copies,
                                                                  hyper, strict=True):
        lr = lrs[group]
        g = g.float() / divisor
        # in the order of torch's fused CUDA kernel (fused_adam_utils.cuh, ADAMW)
        m_new = beta1 * m + (1 - beta1) * g
        v_new = beta2 * v + (1 - beta2) * g * g
        denom = v_new.sqrt() / (1 - beta2**taken).sqrt() + eps
        p_new = p - lr * decay * p
        p_new = p_new - lr / (1 - beta1**taken) * m_new / denom
        p_new, m_new, v_new = (torch.where(keep, new, old) for new, old in ((p_new, p), (m_new, m), (v_new, v)))
        p.copy_(p_new)
        m.copy_(m_new)
        v.copy_(v_new)
        if copy is not None:
            copy.copy_(p_new)
    step.add_(keep.float())
    return norm


class CompiledAdamW:
    """The update of `optimizer` (a torch.optim.AdamW whose state it reads and writes in torch's layout) through
    adamw_update, compiled on first use. `pairs`: (trainable master, the compute-dtype copy the model uses or
    None); each gradient is read from the master, else from the copy (kept in the compute dtype: one micro-batch)."""

    def __init__(self, optimizer: torch.optim.Optimizer, copies: dict[int, torch.Tensor]) -> None:
        self.optimizer, self.copies = optimizer, copies  # copies: id(master) -> its compute copy
        self.compiled: Any = None

    def step(self, max_grad_norm: float, skip_nonfinite: bool) -> torch.Tensor | None:
        """Queue the update; the gradient norm (None where no master has a gradient: nothing to update)."""
        params, grads, hyper, lrs = [], [], [], []
        for index, group in enumerate(self.optimizer.param_groups):
            lrs.append(float(group["lr"]))
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                params.append(p)
                grads.append(grad)
                hyper.append((index, float(group["weight_decay"]), *map(float, group["betas"]), float(group["eps"])))
        if not params:
            return None
        device = params[0].device
        step = self._step_tensor(params, device)
        states = [self._state(p, step) for p in params]
        if self.compiled is None:
            self.compiled = torch.compile(adamw_update, fullgraph=True, dynamic=False)
        lr_host = torch.tensor(lrs, dtype=torch.float32)
        lr = lr_host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else lr_host.to(device)
        with torch.no_grad():
            norm = self.compiled(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                                 [self.copies.get(id(p)) for p in params], step, lr, tuple(hyper),
                                 max_grad_norm, skip_nonfinite)
        return norm

    def _grad(self, master: torch.Tensor) -> torch.Tensor | None:
        if master.grad is not None:
            return master.grad
        copy = self.copies.get(id(master))
        return None if copy is None else copy.grad

    def zero_grad(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
                copy = self.copies.get(id(p))
                if copy is not None:
                    copy.grad = None

    def _step_tensor(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The steps taken, one fp32 tensor on the device shared by every parameter's state (torch keeps one per
        parameter; a loaded checkpoint brings those back, all equal: the first one's count is taken)."""
        for p in params:
            step = self.optimizer.state.get(p, {}).get("step")
            if step is not None:
                if step.device == device and step.dtype == torch.float32 and step.dim() == 0:
                    return step
                return torch.full((), float(step), dtype=torch.float32, device=device)
        return torch.zeros((), dtype=torch.float32, device=device)

    def _state(self, p: torch.Tensor, step: torch.Tensor) -> dict[str, Any]:
        state = self.optimizer.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] = step
        return state

