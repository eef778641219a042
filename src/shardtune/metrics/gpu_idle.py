"""Where the GPU waited in a profiled step: the idle gaps between kernels in a torch.profiler Chrome trace,
each put down to what the host was doing when it launched the kernel that ended the gap.

A gap ends with a kernel whose launch (the `cudaLaunchKernel` / `cuLaunchKernelEx` call with the kernel's
correlation id) came either after the GPU had gone idle (the host was late: the label is the operators that
launched it, outermost > innermost, on the launching thread) or before (the kernel was queued and waited on
something else: another stream's event, a copy; labelled "queued"). A late launch right after a host-device
synchronisation is labelled "after SYNC_CALL in OPERATORS" (the operators that made the call, e.g. a .item()):
the sync drained the queue, so the kernels after it start as fast as the host launches them. A step that is
GPU-bound idles well under 2% of its time."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SYNC_WORDS = ("Synchronize", "cudaMemcpy ", "cudaStreamWaitEvent")  # a plain cudaMemcpy blocks; Async does not
MIN_GAP_US = 5.0  # shorter gaps are the GPU's own launch latency between back-to-back kernels


@dataclass
class IdleReport:
    window_us: float = 0.0
    busy_us: float = 0.0
    steps: int = 0
    by_label: dict[str, list[float]] = field(default_factory=dict)  # label -> [count, total us, largest us]

    def add(self, label: str, gap: float) -> None:
        row = self.by_label.setdefault(label, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += gap
        row[2] = max(row[2], gap)

    @property
    def idle_us(self) -> float:
        return max(0.0, self.window_us - self.busy_us)

    def text(self, top: int = 15) -> str:
        if not self.window_us:
            return "GPU idle: no GPU kernels in the trace\n"
        per = max(1, self.steps)
        lines = [f"GPU idle: {self.idle_us / 1e3 / per:.2f} ms a step of {self.window_us / 1e3 / per:.2f} "
                 f"({100 * self.idle_us / self.window_us:.1f}%) over {self.steps} step(s); gaps of at least "
                 f"{MIN_GAP_US:g} us by what ended them (ms a step, count, largest ms):"]
        rows = sorted(self.by_label.items(), key=lambda kv: -kv[1][1])[:top]
        lines += [f"  {v[1] / 1e3 / per:8.3f}  {int(v[0]):6d}  {v[2] / 1e3:7.3f}  {label}" for label, v in rows]
        return "\n".join(lines) + "\n"


def x_events(events: list[dict[str, Any]], cats: tuple[str, ...]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats and "ts" in e]


def step_window(events: list[dict[str, Any]], gpu: list[dict[str, Any]]) -> tuple[float, float, int]:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") in ("user_annotation", "cpu_op")]
    if steps:
        return (min(float(e["ts"]) for e in steps), max(float(e["ts"]) + float(e.get("dur", 0)) for e in steps),
                len(steps))
    return float(gpu[0]["ts"]), max(float(e["ts"]) + float(e.get("dur", 0)) for e in gpu), 0


def _stacks_at(ops: list[dict[str, Any]], times: list[float]) -> list[list[str]]:
    """For each time (ascending), the names of the operators on one thread that contain it, outermost first:
    one sweep with a stack, since operators on a thread nest."""
    ops = sorted(ops, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    out, stack, j = [], [], 0  # stack: (end, name)
    for t in times:
        while j < len(ops) and float(ops[j]["ts"]) <= t:
            begin = float(ops[j]["ts"])
            while stack and stack[-1][0] < begin:
                stack.pop()
            stack.append((begin + float(ops[j].get("dur", 0)), str(ops[j]["name"])))
            j += 1
        while stack and stack[-1][0] < t:
            stack.pop()
        out.append([name for _, name in stack])
    return out


def _label(stack: list[str]) -> str:
    stack = [n for n in stack if not n.startswith("ProfilerStep#")]
    if not stack:
        return "host, outside any operator"
    return stack[0] if len(stack) == 1 else f"{stack[0]} > {stack[-1]}"


def idle_report(trace: dict[str, Any]) -> IdleReport:
    """The GPU's idle time inside the profiled steps, grouped by what ended each gap (see the module doc)."""
    events = trace.get("traceEvents", [])
    gpu = sorted(x_events(events, GPU_CATS), key=lambda e: float(e["ts"]))
    report = IdleReport()
    if not gpu:
        return report
    lo, hi, report.steps = step_window(events, gpu)
    report.window_us = hi - lo
    launches = {e.get("args", {}).get("correlation"): e for e in x_events(events, LAUNCH_CATS)}
    syncs = sorted(((float(e["ts"]) + float(e.get("dur", 0)), e) for e in x_events(events, LAUNCH_CATS)
                    if any(w in str(e["name"]) + " " for w in SYNC_WORDS)), key=lambda s: s[0])
    sync_ends = [s[0] for s in syncs]
    # thread -> (host time, gap, label prefix): gaps labelled by the operators around that time on that thread
    late: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    end = lo
    for k in gpu:
        ts, te = float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))
        if te <= lo or ts >= hi:
            continue
        ts, te = max(ts, lo), min(te, hi)
        gap = ts - end
        if gap >= MIN_GAP_US:
            label, host = _gap_label(k, end, launches, syncs, sync_ends)
            if label is None or label.startswith("after "):
                late[(host.get("pid"), host.get("tid"))].append((float(host["ts"]), gap, label or ""))
            else:
                report.add(label, gap)
        report.busy_us += max(0.0, te - max(ts, end))
        end = max(end, te)
    ops_by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in x_events(events, ("cpu_op", "user_annotation")):
        ops_by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for key, queries in late.items():
        queries.sort()
        stacks = _stacks_at(ops_by_thread.get(key, []), [q[0] for q in queries])
        for (_, gap, prefix), stack in zip(queries, stacks, strict=True):
            report.add(prefix + _label(stack), gap)
    return report


def _gap_label(kernel: dict[str, Any], idle_from: float, launches: dict[Any, dict[str, Any]],
               syncs: list[tuple[float, dict[str, Any]]], sync_ends: list[float]) -> tuple[str | None, dict[str, Any]]:
    """(label, host event) of the gap a kernel ends: label None when the host launched it late, "after SYNC in "
    when a sync drained the queue first; both completed later with the operators around the host event (the
    launch, or the sync call)."""
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return "kernel with no launch record", {}
    t = float(launch["ts"])
    if t < idle_from:
        return "queued (waited on another stream or event)", launch
    i = bisect.bisect_right(sync_ends, t) - 1
    if i >= 0 and sync_ends[i] >= idle_from:
        return f"after {syncs[i][1]['name']} in ", syncs[i][1]
    return None, launch
