"""Probe for issue 17's next 1B lever: can the weight gradients come out of the matmul in fp32?

On the one-GPU direct path each bf16 weight gradient is cast into its fp32 master after backward made it (4.6 ms
of a ~135 ms 1B step in call 43's profile, against ~1.6 ms of HBM traffic). A matmul that writes fp32 directly
(`torch.mm(a, b, out_dtype=torch.float32)`, CUDA only) would drop that cast and the bf16 gradient. This times, at
the Llama-3.2-1B shapes (8,192 tokens a micro-batch), per weight and over one step's 16 blocks:
  bf16+cast   dy^T @ x in bf16, then .float()          (today)
  mm_fp32     torch.mm(dy^T, x, out_dtype=float32)
  compiled    the same inside torch.compile (does Inductor keep it, and at what cost?)
and checks mm_fp32 against the fp32 matmul of the same bf16 inputs (it should be closer than bf16+cast).

    python3 bench/probe_wgrad.py            (device: ~1 minute; CPU: prints that it needs CUDA)
"""

from __future__ import annotations

import statistics

import torch

TOKENS, HIDDEN, KV, FFN, LAYERS = 8192, 2048, 512, 8192, 16
SHAPES = {"q/o": (HIDDEN, HIDDEN, 2), "k/v": (KV, HIDDEN, 2), "gate/up": (FFN, HIDDEN, 2), "down": (HIDDEN, FFN, 1)}


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _times(dyt: torch.Tensor, x: torch.Tensor, compiled: object, name: str) -> dict[str, float]:
    t = {"bf16+cast": _time(lambda: (dyt @ x).float()),
         "mm_fp32": _time(lambda: torch.mm(dyt, x, out_dtype=torch.float32))}
    try:
        t["compiled"] = _time(lambda: compiled(dyt, x))
    except Exception as err:  # the probe's question: report, do not stop
        t["compiled"] = float("nan")
        print(f"compiled mm out_dtype failed for {name}: {type(err).__name__}: {err}")
    return t


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_wgrad: needs CUDA (torch.mm's out_dtype is a CUDA kernel); nothing measured")
        return 0
    dev = torch.device("cuda")
    compiled = torch.compile(lambda a, b: torch.mm(a, b, out_dtype=torch.float32))
    rows, totals = [], {"bf16+cast": 0.0, "mm_fp32": 0.0, "compiled": 0.0}
    for name, (out_f, in_f, per_layer) in SHAPES.items():
        dyt = torch.randn(TOKENS, out_f, device=dev, dtype=torch.bfloat16).t()
        x = torch.randn(TOKENS, in_f, device=dev, dtype=torch.bfloat16)
        t = _times(dyt, x, compiled, name)
        exact = dyt.float() @ x.float()
        err_cast = ((dyt @ x).float() - exact).abs().max().item()
        err_fp32 = (torch.mm(dyt, x, out_dtype=torch.float32) - exact).abs().max().item()
        rows.append((name, t, err_cast, err_fp32))
        for k in totals:
            totals[k] += t[k] * per_layer * LAYERS
    print("| weight | bf16 + cast ms | mm out_dtype fp32 ms | compiled ms | max err bf16+cast | max err fp32 out |")
    print("|---|---|---|---|---|---|")
    for name, t, e1, e2 in rows:
        print(f"| {name} | {t['bf16+cast']:.3f} | {t['mm_fp32']:.3f} | {t['compiled']:.3f} | {e1:.3g} | {e2:.3g} |")
    step = totals
    print(f"| one step, 16 blocks | {step['bf16+cast']:.2f} | {step['mm_fp32']:.2f} | {step['compiled']:.2f} | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
