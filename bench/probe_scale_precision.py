"""Does a bf16 tensor's in-place multiply by a 0-d fp32 tensor on the GPU keep the scale in fp32?

Liger's fused-loss backward scales its saved gradients by the loss's incoming gradient in a Triton kernel that
multiplies in fp32, after a `torch.equal(grad_output, 1.0)` test that waits for the GPU (bench/RESULTS.md,
nineteenth session). A sync-free swap (`grad.mul_(grad_output)`, commit 9084190, taken out) is exact only if torch
multiplies a bf16 tensor by a 0-d fp32 CUDA tensor without first rounding the scale to bf16. On CPU it does not
round (the 0-d tensor is read as a scalar of its own precision); this checks CUDA.

    python3 bench/probe_scale_precision.py     (device: seconds; CPU: runs the CPU check only)
"""

from __future__ import annotations

import torch


def check(device: str) -> dict[str, bool]:
    torch.manual_seed(0)
    x = torch.randn(1 << 20, device=device).bfloat16()
    s = torch.tensor(0.0123456789, dtype=torch.float32, device=device)
    want = (x.float() * s).bfloat16()  # the fp32 multiply, rounded once
    rounded = (x.float() * s.bfloat16().float()).bfloat16()  # the scale rounded to bf16 first
    a = x.clone()
    a.mul_(s)
    b = x.clone()
    torch._foreach_mul_([b], s)
    return {"mul_ keeps fp32 scale": torch.equal(a, want), "mul_ rounds the scale": torch.equal(a, rounded),
            "_foreach_mul_ keeps fp32 scale": torch.equal(b, want)}


if __name__ == "__main__":
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        print(device, check(device))
