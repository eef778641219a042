"""Wall time per call for the bench probes (probe_fp8_frozen.py, probe_offload.py): on a GPU the device is
synchronised before and after each call, so a call's time is its kernels', not its launches'."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def times_ms(fn: Callable[[], object], steps: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def spread(ms: list[float]) -> dict[str, float]:
    """The median with its min-max, as bench/RESULTS.md quotes them."""
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "n": len(ms)}
