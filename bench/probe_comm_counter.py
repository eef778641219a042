"""Issue 18: the host cost of the comm counter (metrics/comm.py) per collective, on one gloo process (CPU).

    python bench/probe_comm_counter.py [--calls 20000] [--repeats 3]

Times `all_gather_into_tensor` of 4 KiB on a world-1 gloo group with and without `comm.counting`; the counter's
cost is the difference (tensor sizes read, a lock, a dict update). Multiply by the collectives of a step
(metrics.jsonl's comm_<kind>_calls) for its share of a step."""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from shardtune.metrics import comm


def per_call_us(calls: int) -> float:
    x, out = torch.zeros(1024), torch.zeros(1024)
    t = time.perf_counter()
    for _ in range(calls):
        dist.all_gather_into_tensor(out, x)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29677")
    dist.init_process_group("gloo", rank=0, world_size=1)
    extra = []
    for _ in range(args.repeats):
        plain = per_call_us(args.calls)
        with comm.counting(comm.CommCounter()):
            counted = per_call_us(args.calls)
        extra.append(counted - plain)
        print(f"us per collective: plain {plain:.2f}, counted {counted:.2f}, counter {counted - plain:.2f}")
    print(f"median counter cost: {statistics.median(extra):.2f} us per collective")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
