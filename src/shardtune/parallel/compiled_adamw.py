"""`optim.fused: compiled` on the one-GPU direct path: the step's gradient norm, clipping, non-finite skip, AdamW
update and the cast of each updated master to the model's compute-dtype copy, as torch.compile'd code.

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
import torch.fx.experimental._config as fx_config

# Parameters per compiled call. One call over every parameter (146 on the 1B shape) made one graph of ~2,200 nodes,
# 124 s to compile on a CPU; chunks of a few flattened tensors, traced with dynamic sizes, reuse a handful of small
# graphs (one per chunk length, weight-decay group and gradient dtype) at ~20 calls a step.
CHUNK = 8


def adamw_chunk(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor] | None, steps: list[torch.Tensor],
                lr: torch.Tensor, divisor: torch.Tensor, keep: torch.Tensor, decay: float, beta1: float,
                beta2: float, eps: float) -> None:
    """AdamW on one chunk of one param group, in place (1-D views). `steps`: each parameter's steps taken so far
    (torch's 0-dim fp32 `step` state, counted here); `divisor`: clipping's (GradScaler's grad_scale); `keep`: False
    skips the step (found_inf); `copies`: the compute-dtype tensors the model computes with, written from the
    updated masters."""
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True)):
        taken = step + 1
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
        step.copy_(torch.where(keep, taken, step))
        if copies is not None:
            copies[i].copy_(p_new)


class CompiledAdamW:
    """The update of `optimizer` (a torch.optim.AdamW whose state it reads and writes in torch's layout): the
    gradient norm over every gradient (torch's multi-tensor norm), then adamw_chunk, compiled on first use, over
    chunks of each param group. `copies`: id(master) -> the compute-dtype tensor the model computes with (absent
    where it computes with the master); each gradient is read from the master, else from the copy (kept in the
    compute dtype: one micro-batch a step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, copies: dict[int, torch.Tensor]) -> None:
        self.optimizer, self.copies = optimizer, copies
        self.compiled: Any = None

    @torch.no_grad()
    def step(self, max_grad_norm: float, skip_nonfinite: bool) -> torch.Tensor | None:
        """Queue the update; the gradient norm before clipping (None where no master has a gradient)."""
        groups = [(group, [(p, g) for p in group["params"] if (g := self._grad(p)) is not None])
                  for group in self.optimizer.param_groups]
        grads = [g for _, pairs in groups for _, g in pairs]
        if not grads:
            return None
        device = grads[0].device
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        keep = torch.isfinite(norm) if skip_nonfinite else torch.ones((), dtype=torch.bool, device=device)
        divisor = (norm + 1e-6).div(max_grad_norm).clamp(min=1.0) if max_grad_norm > 0 else torch.ones_like(norm)
        lrs = self._lrs([group["lr"] for group, _ in groups], device)
        if self.compiled is None:
            self.compiled = torch.compile(adamw_chunk, fullgraph=True, dynamic=True)
        # a few graphs of one function by design; each tensor's size its own symbol, so chunks whose sizes repeat
        # differently (duck sizing) share a graph (the settings entered once a step, not per chunk: host time)
        with torch._dynamo.config.patch(recompile_limit=64), fx_config.patch(use_duck_shape=False):
            for index, (group, pairs) in enumerate(groups):
                hyper = (float(group["weight_decay"]), *map(float, group["betas"]), float(group["eps"]))
                for chunk in self._chunks(pairs):
                    states = [self._state(p, device) for p, _ in chunk]
                    copies = ([self.copies[id(p)].view(-1) for p, _ in chunk] if id(chunk[0][0]) in self.copies
                              else None)
                    self.compiled([p.view(-1) for p, _ in chunk], [g.reshape(-1) for _, g in chunk],
                                  [s["exp_avg"].view(-1) for s in states], [s["exp_avg_sq"].view(-1) for s in states],
                                  copies, [s["step"] for s in states], lrs[index], divisor, keep, *hyper)
        # What torch's LR scheduler marks when the optimizer's own step() runs; without it the schedule's first
        # step warns that it came before the optimizer's (it did not: this was the update).
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return norm

    def _chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Runs of up to CHUNK parameters alike in what the compiled graph specialises on: whether the model
        computes with a copy, and the gradient's dtype."""
        chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for p, g in pairs:
            kind = (id(p) in self.copies, g.dtype)
            last = chunks[-1] if chunks else None
            if last and len(last) < CHUNK and (id(last[0][0]) in self.copies, last[0][1].dtype) == kind:
                last.append((p, g))
            else:
                chunks.append([(p, g)])
        return chunks

    @staticmethod
    def _lrs(lrs: list[float], device: torch.device) -> torch.Tensor:
        """The groups' learning rates on the device, copied without the host waiting for the GPU's queue."""
        host = torch.tensor([float(lr) for lr in lrs], dtype=torch.float32)
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)

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

    def _state(self, p: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """`p`'s AdamW state in torch's layout, made at its first update; its step count a 0-dim fp32 tensor on
        the device, as torch's fused AdamW keeps it (one per parameter: one without a gradient in a step is not
        counted; a checkpoint of the foreach update brings it on the host, moved here once)."""
        state = self.optimizer.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state.get("step")
        if step is None:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        elif not isinstance(step, torch.Tensor) or step.device != device or step.dtype != torch.float32:
            state["step"] = torch.as_tensor(step, dtype=torch.float32).reshape(()).to(device)
        return state
