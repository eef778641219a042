"""Device utilisation sampled in a background thread: through NVML (nvidia-ml-py, `pip install -e '.[gpu-monitor]'`)
on NVIDIA GPUs, each GPU's busy share, memory used, power and temperature; elsewhere (no GPU, no NVML library, or
a driver that does not answer) the process's resident set. The GPUs sampled are the ones this node's processes
train on (local rank k on the k-th visible GPU): the first LOCAL_WORLD_SIZE of CUDA_VISIBLE_DEVICES (indices, or GPU
UUIDs matched through NVML; all of the node's GPUs where it is unset), not a neighbouring job's. The loop reads the
samples at each metrics record; the thread only reads counters, so it never waits on the GPU's work."""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
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
    (mean), gpu_sm_clock_mhz (min) and gpu_clock_events (the slowdowns NVML named at any sample: power_cap,
    hw_slowdown, sw_thermal, hw_thermal, power_brake; both left out where the GPU does not report them): a step
    slower than its neighbours with a lower clock was slowed by the GPU, not by the host; or rss_gib (max) without
    NVML, `nvml_error` then saying why (also logged once)."""

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
        fields: dict[str, list[Any]] = {k: [] for k in _FIELDS}
        for h in self.handles:
            try:
                values = (float(nv.nvmlDeviceGetUtilizationRates(h).gpu), nv.nvmlDeviceGetMemoryInfo(h).used / GIB,
                          nv.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
                          float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                          _optional(lambda h=h: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
                          _optional(lambda h=h: int(_clock_reasons(nv)(h))))
            except Exception:  # one GPU that does not answer a query: its value is left out this time
                continue
            for key, value in zip(_FIELDS, values, strict=True):
                fields[key].append(value)
        return fields

    def take(self) -> dict[str, Any]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            self.sample()
            with self._lock:
                samples, self._samples = self._samples, []
        if "rss_gib" in samples[0]:
            return {"rss_gib": max(s["rss_gib"] for s in samples)}
        whole = [s for s in samples if len(s["gpu_util_pct"]) == len(self.handles)]
        out: dict[str, Any] = {}
        for key, agg in (("gpu_util_pct", _mean), ("gpu_mem_used_gib", max), ("gpu_power_w", _mean),
                         ("gpu_temp_c", max), ("gpu_sm_clock_mhz", min)):
            per_gpu = list(zip(*[s[key] for s in whole], strict=False))
            if not per_gpu or any(v is None for gpu in per_gpu for v in gpu):  # a GPU that reports no clock
                continue
            out[key] = [round(agg(v), 3) for v in per_gpu]
        bits = list(zip(*[s["gpu_clock_events"] for s in whole], strict=False))
        if bits and all(v is not None for gpu in bits for v in gpu):
            out["gpu_clock_events"] = [_event_names(functools.reduce(operator.or_, gpu)) for gpu in bits]
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


# NVML's clock event ("throttle") reasons that slow a busy GPU: its power cap, heat, a hardware brake. ("Idle" is
# left out: the record's own sample is taken just after the loop waited for the GPU, which is then idle.)
_CLOCK_EVENTS = (("power_cap", 0x4), ("hw_slowdown", 0x8), ("sw_thermal", 0x20),
                 ("hw_thermal", 0x40), ("power_brake", 0x80))
_FIELDS = ("gpu_util_pct", "gpu_mem_used_gib", "gpu_power_w", "gpu_temp_c", "gpu_sm_clock_mhz", "gpu_clock_events")


def _clock_reasons(nv: Any) -> Any:
    # the name since nvidia-ml-py 12.535; the older one is kept as a deprecated alias
    return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons


def _event_names(bits: int) -> list[str]:
    return [name for name, bit in _CLOCK_EVENTS if bits & bit]


def _optional(query: Any) -> Any:
    """A query some GPUs or drivers do not support (NVMLError_NotSupported): None there."""
    try:
        return query()
    except Exception:
        return None


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)
