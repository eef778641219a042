"""Would caching the frozen base's float8 weights pay for LoRA? (issue 17; the float8 LoRA rows of calls 65-66)

`train.float8` with LoRA runs the frozen base layers through torchao's Float8Linear, which casts the bf16 weight to
float8 (an amax pass and a cast pass over every weight) in the forward, again in the recompute and again in the
backward: ~5 bytes moved per weight each time, ~100 GB a step on the 8B shape, where the whole step is ~310 ms on an
H200 (calls 65-66). A frozen weight's tensorwise scale never changes, so its float8 copy can be made once (torchao's
matmul takes an already-cast weight as it is) and the bf16 weight freed: 6.5 GiB less on the 8B. This probe times
one Llama-3-8B block's seven projections (tokens x 4096 into q, k, v, o, gate, up, down; frozen weights, the input's
gradient only, compiled) as plain bf16, as Float8Linear, and as Float8Linear fed the cached cast, and checks that
the cached path gives the dynamic path's outputs and input gradients bit for bit.

    PYTHONPATH=src python3 bench/probe_fp8_frozen.py               (GPU of compute capability 8.9+: ~1 minute)
    PYTHONPATH=src python3 bench/probe_fp8_frozen.py --cpu --tiny  (the plumbing and the bit-for-bit check, on CPU)

The cached path is shardtune.models.float8.cache_frozen_weights (the bf16 weights' storage freed).
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import spread, times_ms
from torch import nn


class Block(nn.Module):
    """The seven projections of a Llama block in their order (attention and norms left out: they do not change)."""

    def __init__(self, h: int, kv: int, f: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(h, h, False), nn.Linear(h, kv, False), nn.Linear(h, kv, False), \
            nn.Linear(h, h, False)
        self.gate, self.up, self.down = nn.Linear(h, f, False), nn.Linear(h, f, False), nn.Linear(f, h, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        a = self.o(q + (k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)) * 1e-3)
        return x + self.down(nn.functional.silu(self.gate(a)) * self.up(a))


def build(kind: str, sizes: tuple[int, int, int], device: str) -> nn.Module:
    torch.manual_seed(0)
    block = Block(*sizes).to(device=device, dtype=torch.bfloat16)
    for p in block.parameters():
        p.requires_grad_(False)  # LoRA's frozen base
    if kind != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    if kind == "float8_cached":
        from shardtune.models.float8 import cache_frozen_weights

        assert cache_frozen_weights(block) == 7
    return block


def timed(block: nn.Module, x: torch.Tensor, steps: int, device: str) -> list[float]:
    def once() -> torch.Tensor:
        xi = x.detach().requires_grad_()
        block(xi).sum().backward()
        return xi.grad

    for _ in range(3):  # compile and warm up
        once()
    return times_ms(once, steps, device == "cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="64-wide layers, 32 tokens")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    args = ap.parse_args()
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    sizes, tokens = ((64, 16, 128), 32) if args.tiny else ((4096, 1024, 14336), args.tokens)
    x = torch.randn(tokens, sizes[0], device=device, dtype=torch.bfloat16)
    rows, results = [], {}
    for kind in ("bf16", "float8", "float8_cached"):
        block = build(kind, sizes, device)
        run = block if args.eager else torch.compile(block)
        xi = x.detach().requires_grad_()
        out = run(xi)
        out.sum().backward()
        results[kind] = (out.detach(), xi.grad)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = timed(run, x, args.steps if device == "cuda" else 2, device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        rows.append({"kind": kind, **spread(ms), "peak_gib": round(peak, 3)})
    same = {name: torch.equal(a, b) for name, a, b in (
        ("output", results["float8"][0], results["float8_cached"][0]),
        ("input_grad", results["float8"][1], results["float8_cached"][1]))}
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"cached_equals_dynamic": same, "device": device, "tokens": tokens, "sizes": sizes,
                      "compiled": not args.eager}))
    base = rows[0]["ms_median"]
    print("| kind | ms per block (median, min-max) | vs bf16 |\n|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['ms_median']:.3f} ({r['ms_min']:.3f}-{r['ms_max']:.3f}) | "
              f"{base / r['ms_median']:.2f}x |")


if __name__ == "__main__":
    main()
