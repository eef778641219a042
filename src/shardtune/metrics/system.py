"""Device utilisation sampled in a background thread: through NVML (nvidia-ml-py, `pip install -e '.[gpu-monitor]'`)
on NVIDIA GPUs, each GPU's busy share, memory used, power and temperature; elsewhere (no GPU, no NVML library, or
a driver that does not answer) the process's resident set. The GPUs sampled are the ones this node's processes
train on (local rank k on the k-th visible GPU): the first LOCAL_WORLD_SIZE of CUDA_VISIBLE_DEVICES (indices, or GPU
UUIDs matched through NVML; all of the node's GPUs where it is unset), not a neighbouring job's. The loop reads the
samples at each metrics record; the thread only reads counters, so it never waits on the GPU's work."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

GIB = 2**30
log = logging.getLogger(__name__)


def _nvml() -> tuple[Any | None, str | None]:
    """(pynvml initialised, None), or (None, why not): the package or the driver's library missing, or a driver
    that does not answer."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install -e '.[gpu-monitor]')"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound / _DriverNotLoaded on a machine without a driver
        return None, f"NVML did not start: {type(err).__name__}: {err}"
    return pynvml, None


def _uuid(nv: Any, handle: Any) -> str:
    uuid = nv.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)  # bytes from older nvidia-ml-py releases


def visible_indices(nv: Any, visible: str | None) -> list[int]:
    """The NVML indices of the GPUs CUDA_VISIBLE_DEVICES (`visible`) names, in its order; every GPU when unset.
    Entries are indices or UUIDs (GPU-..., a unique prefix is enough, as CUDA takes them); as CUDA does, the list
    ends at the first entry that names no GPU (so "" is none). MIG slices' UUIDs name no whole GPU: not sampled.
    An index is NVML's (PCI bus order), which is CUDA's own order under CUDA_DEVICE_ORDER=PCI_BUS_ID and, on the
    nodes of one GPU model this tool targets, its default order too."""
    count = nv.nvmlDeviceGetCount()
    if visible is None:
        return list(range(count))
    uuids: list[str] | None = None  # read only when an entry is a UUID
    out: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        elif entry.startswith("GPU-"):
            uuids = uuids if uuids is not None else [_uuid(nv, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
            index = next((i for i, u in enumerate(uuids) if u.startswith(entry)), -1)
        else:
            index = -1
        if index < 0:
            break
        out.append(index)
    return out


def rss_gib() -> float:
    """This process's current resident set (Linux /proc; 0.0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / GIB


class SystemSampler:
    """Samples every `period_s` seconds in a daemon thread; `take()` gives the interval's summary fields, one list
    entry per sampled GPU: gpu_util_pct (mean of NVML's utilization.gpu: the share of time a kernel was running,
    "GPU busy", not SM occupancy or how many SMs worked), gpu_mem_used_gib and gpu_temp_c (max), gpu_power_w
    (mean); or rss_gib (max) without NVML, `nvml_error` then saying why (also logged once)."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.nvml, self.nvml_error = _nvml()
        self.indices: list[int] = []
        self.handles: list[Any] = []
        if self.nvml is not None:
            self._open_handles()
        if self.nvml_error:
            log.info("system sampler: %s; sampling the process's resident set (rss_gib)", self.nvml_error)
        self._samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardtune-system-sampler", daemon=True)

    def _open_handles(self) -> None:
        try:
            visible = visible_indices(self.nvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
            # dist.init_distributed puts local rank k on cuda:k: a node running fewer processes than it sees GPUs
            # leaves the rest to others.
            self.indices = visible[:int(os.environ.get("LOCAL_WORLD_SIZE", len(visible)))]
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        except Exception as err:  # a driver that starts but does not answer a query: no GPU stats
            self.nvml_error = f"NVML did not list the GPUs: {type(err).__name__}: {err}"
        if not self.handles:
            self.nvml_error = self.nvml_error or "no GPU of CUDA_VISIBLE_DEVICES found through NVML"
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            self.nvml, self.indices, self.handles = None, [], []

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
