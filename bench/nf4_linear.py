"""One 8B-shape projection, forward + input-gradient, NF4 weight: shardtune's fused NF4Linear vs
torchao's eager NF4 linear vs bitsandbytes' 4-bit matmul vs a plain bf16 weight (GPU only).

    python bench/nf4_linear.py [--rows 14336 --cols 4096 --tokens 4096]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from shardtune.peft.nf4_linear import nf4_dequantize, nf4_linear
from shardtune.peft.qlora import _nf4_api


def timed(fn, x: torch.Tensor, reps: int = 20) -> float:
    """Median ms of forward + backward of the input gradient."""
    for _ in range(3):
        fn(x).sum().backward()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timed_plain(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    dev = torch.device("cuda")
    w = torch.randn(a.rows, a.cols, device=dev) * 0.02
    x = torch.randn(a.tokens, a.cols, device=dev, dtype=torch.bfloat16, requires_grad=True)
    _, to_nf4 = _nf4_api()
    nf4 = to_nf4(w, 64, 256)
    wb = w.bfloat16()
    rows = {"bf16 weight (F.linear)": lambda t: F.linear(t, wb),
            "shardtune NF4Linear (fused dequant)": lambda t: nf4_linear(t, nf4),
            "torchao NF4 (eager dequant)": lambda t: F.linear(t, nf4)}
    try:
        import bitsandbytes as bnb

        q, state = bnb.functional.quantize_4bit(wb, quant_type="nf4", compress_statistics=True)
        rows["bitsandbytes matmul_4bit (nf4, double quant)"] = lambda t: bnb.matmul_4bit(t, q.t(), quant_state=state)
    except Exception as err:  # not installed, no CUDA kernels for this GPU
        print(f"bitsandbytes skipped: {type(err).__name__}: {err}")
    # Training dequantizes weights of several sizes through one dynamic-size kernel: compile it so.
    for n, k in [(1024, a.cols), (a.cols, a.cols)]:
        nf4_dequantize(to_nf4(torch.randn(n, k, device=dev), 64, 256), torch.bfloat16)
    ms = timed_plain(lambda: nf4_dequantize(nf4, torch.bfloat16))
    moved = nf4.numel() * (0.5 + 2)  # read the half-byte codes, write bf16
    print(f"dequantize only: {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s")
    ref = F.linear(x, nf4.get_original_weight().bfloat16())
    print(f"projection {a.rows} x {a.cols}, {a.tokens} tokens, bf16 activations")
    print("| linear | fwd+bwd ms | max |out - dequant ref| |")
    print("|---|---|---|")
    for name, fn in rows.items():
        ms = timed(fn, x)
        with torch.no_grad():
            err = float((fn(x) - ref).abs().max())
        print(f"| {name} | {ms:.3f} | {err:.3g} |")


if __name__ == "__main__":
    main()
