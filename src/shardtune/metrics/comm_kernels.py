"""Achieved bus bandwidth of the run's collectives, from the NCCL kernels of the `log.profile` steps.

The comm counter (metrics/comm.py) knows the bytes of every collective but not how long each took: its work
runs on NCCL's own streams, and timing it in every step would need CUDA events read back, a sync. The profiled
steps have both: the trace holds each NCCL kernel's GPU time, and the counter the bus bytes of the same steps.
Bus bandwidth = bus bytes / kernel time, by collective (NCCL's busbw convention, as nccl-tests reports it, so
the numbers compare with the planner's calibrated `intra_node_bus_bytes_per_s`).

A kernel's time includes any wait for a peer rank to arrive at the same collective, so ranks that reach it
apart show a lower bandwidth than the link gives; rank 0's numbers go into summary.json.
"""

from __future__ import annotations

from typing import Any

from shardtune.metrics.gpu_idle import GPU_CATS, step_window, x_events

# NCCL kernel names, e.g. ncclDevKernel_AllGather_RING_LL(...), ncclDevKernel_ReduceScatter_Sum_f32_RING_LL,
# ncclKernel_AllReduce_RING_LL_Sum_float. Order matters: "reduce" last, since it is in the other names.
NCCL_KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
              ("broadcast", "broadcast"), ("sendrecv", "all_to_all"), ("alltoall", "all_to_all"),
              ("reduce", "reduce"))


def nccl_kind(name: str) -> str | None:
    """The collective an NCCL kernel runs (comm.py's kinds), or None for any other kernel."""
    low = name.lower()
    if not low.startswith("nccl"):
        return None
    low = low.split("(", 1)[0].replace("_", "")
    for word, kind in NCCL_KINDS:
        if word in low:
            return kind
    return "other"


def kernel_time(trace: dict[str, Any]) -> tuple[dict[str, list[float]], int]:
    """({kind: [kernels, microseconds]} of the NCCL kernels inside the profiled steps, the number of steps)."""
    events = trace.get("traceEvents", [])
    gpu = x_events(events, GPU_CATS)
    if not gpu:
        return {}, 0
    lo, hi, steps = step_window(events, sorted(gpu, key=lambda e: float(e["ts"])))
    out: dict[str, list[float]] = {}
    for k in gpu:
        kind = nccl_kind(str(k.get("name", "")))
        ts = float(k["ts"])
        if kind is None or not lo <= ts < hi:
            continue
        row = out.setdefault(kind, [0, 0.0])
        row[0] += 1
        row[1] += float(k.get("dur", 0))
    return out, steps


def bandwidth(trace: dict[str, Any], comm_totals: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """By collective: bus bytes, NCCL kernel time and kernels per profiled step, and the achieved bus bandwidth
    (bytes/s; absent where the trace has no kernel of that kind). `comm_totals`: the counter's totals over the
    same steps (comm.py's `take()` merged)."""
    time_us, steps = kernel_time(trace)
    per = max(steps, 1)
    out: dict[str, dict[str, float]] = {}
    for kind in sorted(set(time_us) | set(comm_totals)):
        bus = comm_totals.get(kind, {}).get("bus_bytes", 0.0)
        kernels, us = time_us.get(kind, [0, 0.0])
        row = {"bus_bytes_per_step": bus / per, "kernel_ms_per_step": us / 1e3 / per,
               "kernels_per_step": kernels / per}
        if us > 0 and bus > 0:
            row["bus_bytes_per_s"] = bus / (us / 1e6)
        out[kind] = row
    return out


def text(rows: dict[str, dict[str, float]]) -> str:
    if not rows:
        return "Collectives: none in the profiled steps\n"
    lines = ["Collectives in the profiled steps, this rank (NCCL kernel time includes waiting for peers):",
             f"  {'collective':<15}{'MiB/step':>10}{'kernels/step':>14}{'ms/step':>10}{'bus GB/s':>10}"]
    for kind, r in rows.items():
        gbps = f"{r['bus_bytes_per_s'] / 1e9:10.1f}" if "bus_bytes_per_s" in r else f"{'-':>10}"
        lines.append(f"  {kind:<15}{r['bus_bytes_per_step'] / 2**20:10.1f}{r['kernels_per_step']:14.1f}"
                     f"{r['kernel_ms_per_step']:10.3f}{gbps}")
    return "\n".join(lines) + "\n"
