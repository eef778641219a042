"""Device utilisation sampled in a background thread: through NVML (nvidia-ml-py) on NVIDIA GPUs, SM
utilisation, memory used, power and temperature of every GPU this node's rank 0 sees; elsewhere (no GPU, or no
NVML library) the process's resident set. The loop reads the samples at each metrics record; the thread only
reads counters, so it never waits on the GPU's work."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

GIB = 2**30


def _nvml() -> Any | None:
    """pynvml, initialised; None where the package or the driver's library is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, NVMLError_LibraryNotFound, a driver that does not answer: no GPU stats
        return None


def rss_gib() -> float:
    """This process's current resident set (Linux /proc; 0.0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / GIB


class SystemSampler:
    """Samples every `period_s` seconds in a daemon thread; `take()` gives the interval's summary fields:
    gpu_util_pct (mean per GPU), gpu_mem_used_gib / gpu_temp_c (max per GPU), gpu_power_w (mean per GPU), or
    rss_gib (max) without NVML."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.nvml = _nvml()
        self.handles = []
        if self.nvml is not None:
            try:
                self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]
            except Exception:
                self.nvml, self.handles = None, []
        self._samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardtune-system-sampler", daemon=True)

    @property
    def source(self) -> str:
        return "nvml" if self.handles else "rss"

    def start(self) -> SystemSampler:
        self.sample()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        s = self._gpu_sample() if self.handles else {"rss_gib": rss_gib()}
        with self._lock:
            self._samples.append(s)

    def _gpu_sample(self) -> dict[str, Any]:
        nv = self.nvml
        util, mem, power, temp = [], [], [], []
        for h in self.handles:
            try:
                util.append(float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
                mem.append(nv.nvmlDeviceGetMemoryInfo(h).used / GIB)
                power.append(nv.nvmlDeviceGetPowerUsage(h) / 1000.0)  # milliwatts
                temp.append(float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            except Exception:  # one GPU that does not answer a query: its value is left out this time
                continue
        return {"gpu_util_pct": util, "gpu_mem_used_gib": mem, "gpu_power_w": power, "gpu_temp_c": temp}

    def take(self) -> dict[str, Any]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            self.sample()
            with self._lock:
                samples, self._samples = self._samples, []
        if "rss_gib" in samples[0]:
            return {"rss_gib": max(s["rss_gib"] for s in samples)}
        out: dict[str, Any] = {}
        for key, agg in (("gpu_util_pct", _mean), ("gpu_mem_used_gib", max), ("gpu_power_w", _mean),
                         ("gpu_temp_c", max)):
            per_gpu = list(zip(*[s[key] for s in samples if len(s[key]) == len(self.handles)], strict=False))
            out[key] = [round(agg(v), 3) for v in per_gpu]
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)
