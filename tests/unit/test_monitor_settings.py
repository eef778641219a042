"""The system sampler without NVML (this machine has no GPU: nvidia-ml-py, if installed, finds no driver) and with a
fake `pynvml` standing in for a driver's answers, the step profiler on CPU, and their config keys."""

from __future__ import annotations

import json
import logging
import sys
import threading
import types

import pytest
import torch

from shardtune.config import ConfigError, config_from_dict
from shardtune.metrics.profile import StepProfiler
from shardtune.metrics.system import GIB, SystemSampler

BASE = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "x.jsonl"}}


def test_sampler_without_nvml_reports_the_process_rss_and_stops():
    sampler = SystemSampler(period_s=0.01).start()
    assert sampler.source == "rss"  # this CPU machine: nvidia-ml-py missing, or installed and finding no driver
    assert sampler.nvml_error == "nvidia-ml-py is not installed (pip install -e '.[gpu-monitor]')" or \
        sampler.nvml_error.startswith("NVML did not start: NVMLError_LibraryNotFound")
    record = sampler.take()
    assert set(record) == {"rss_gib"} and record["rss_gib"] > 0
    sampler.close()
    assert not any(t.name == "shardtune-system-sampler" for t in threading.enumerate())


class _Util:
    def __init__(self, gpu: float) -> None:
        self.gpu = gpu


class _Mem:
    def __init__(self, used: float) -> None:
        self.used = used


def fake_pynvml(gpus: int, fail_init: bool = False, clocks: bool = True) -> types.ModuleType:
    """pynvml's calls the sampler makes, answering for `gpus` GPUs. GPU i at its n-th query (n = 0, 1, ...) is
    10*i + 10*n percent busy, (i + 1 + n) GiB used, 100*(i + 1) + 50*n W, 40 + i + 5*n degrees, its SM clock at
    1980 - 100*i - 300*n MHz, and its clock event reasons: GPU 1's first sample the power cap and idle, its second
    hardware thermal slowdown, GPU 0 none: every field differs per GPU and per sample, so a mix-up of GPUs or of
    aggregations shows. `clocks=False`: a GPU that answers NotSupported to the clock queries."""
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0
    nv.NVML_CLOCK_SM = 1
    nv.NVMLError = type("NVMLError", (Exception,), {})
    nv.NVMLError_DriverNotLoaded = type("NVMLError_DriverNotLoaded", (nv.NVMLError,), {})
    nv.queries = [0] * gpus  # utilisation queries answered per GPU: the sample number
    nv.shutdowns = 0

    def init():
        if fail_init:
            raise nv.NVMLError_DriverNotLoaded("Driver Not Loaded")

    def shutdown():
        nv.shutdowns += 1

    def util(i):
        nv.queries[i] += 1
        return _Util(10 * i + 10 * (nv.queries[i] - 1))

    n = lambda i: nv.queries[i] - 1  # noqa: E731 - the sample the other fields belong to
    nv.nvmlInit, nv.nvmlShutdown, nv.nvmlDeviceGetCount = init, shutdown, lambda: gpus
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # the handle is the index
    nv.nvmlDeviceGetUUID = lambda i: f"GPU-{'abcdefgh'[i] * 8}-0000".encode()  # bytes, as older releases give
    nv.nvmlDeviceGetUtilizationRates = util
    nv.nvmlDeviceGetMemoryInfo = lambda i: _Mem((i + 1 + n(i)) * GIB)
    nv.nvmlDeviceGetPowerUsage = lambda i: (100 * (i + 1) + 50 * n(i)) * 1000  # milliwatts
    nv.nvmlDeviceGetTemperature = lambda i, sensor: 40 + i + 5 * n(i)

    def clock(i, kind):
        if not clocks or kind != nv.NVML_CLOCK_SM:
            raise nv.NVMLError("Not Supported")
        return 1980 - 100 * i - 300 * n(i)

    def reasons(i):
        if not clocks:
            raise nv.NVMLError("Not Supported")
        return 0 if i == 0 else (0x4 | 0x1, 0x40)[n(i) % 2]

    nv.nvmlDeviceGetClockInfo, nv.nvmlDeviceGetCurrentClocksEventReasons = clock, reasons
    return nv


def test_no_driver_falls_back_to_rss_with_one_line_why(monkeypatch, caplog):
    nv = fake_pynvml(2, fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    with caplog.at_level(logging.INFO, logger="shardtune.metrics.system"):
        sampler = SystemSampler(period_s=0.01).start()
    record = sampler.take()
    sampler.close()
    assert sampler.source == "rss" and set(record) == {"rss_gib"} and record["rss_gib"] > 0
    assert sampler.nvml_error == "NVML did not start: NVMLError_DriverNotLoaded: Driver Not Loaded"
    lines = [r.getMessage() for r in caplog.records if r.name == "shardtune.metrics.system"]
    assert len(lines) == 1 and "Driver Not Loaded" in lines[0] and "rss_gib" in lines[0], lines
    assert nv.queries == [0, 0]  # no GPU query after a failed start


def test_two_gpus_each_summarised_over_the_interval(monkeypatch):
    """Two samples of two GPUs: per GPU, the mean busy % and power, the max memory and temperature."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sampler = SystemSampler()
    assert sampler.source == "nvml" and sampler.nvml_error is None and sampler.indices == [0, 1]
    sampler.sample()
    sampler.sample()
    assert sampler.take() == {"gpu_util_pct": [5.0, 15.0], "gpu_mem_used_gib": [2.0, 3.0],
                              "gpu_power_w": [125.0, 225.0], "gpu_temp_c": [45.0, 46.0],
                              "gpu_sm_clock_mhz": [1680.0, 1580.0],  # the lowest sample's
                              "gpu_clock_events": [[], ["power_cap", "hw_thermal"]]}  # any sample's, idle left out
    sampler.sample()
    assert sampler.take()["gpu_clock_events"] == [[], ["power_cap"]]  # the next interval starts afresh
    sampler.close()
    assert sampler.nvml.shutdowns == 1


def test_a_gpu_without_clock_reports_leaves_those_fields_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(2, clocks=False))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sampler = SystemSampler()
    sampler.sample()
    assert set(sampler.take()) == {"gpu_util_pct", "gpu_mem_used_gib", "gpu_power_w", "gpu_temp_c"}
    sampler.close()


@pytest.mark.parametrize("visible, local_world, indices", [
    ("2,3", None, [2, 3]),
    ("3,1", None, [3, 1]),  # CUDA's order: the first visible GPU (cuda:0) is NVML's 3
    ("GPU-cccccccc-0000,GPU-aaaa", None, [2, 0]),  # UUIDs, whole or a unique prefix
    ("1,GPU-zzzz,3", None, [1]),  # as CUDA: the list ends at the first entry that names no GPU
    ("2,7", None, [2]),
    ("2,3,0", "2", [2, 3]),  # 2 processes on this node: cuda:0 and cuda:1 only
    (None, "2", [0, 1]),
])
def test_only_the_gpus_this_node_trains_on_are_sampled(monkeypatch, visible, local_world, indices):
    nv = fake_pynvml(4)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    sampler = SystemSampler()
    assert sampler.indices == indices
    record = sampler.take()
    assert record["gpu_temp_c"] == [40.0 + i for i in indices]  # GPU i's own answers, in CUDA's order
    assert [i for i, q in enumerate(nv.queries) if q] == sorted(indices)  # the others never queried


@pytest.mark.parametrize("visible", ["", "-1", "MIG-0b1c2d3e"])
def test_no_visible_gpu_falls_back_to_rss(monkeypatch, visible):
    nv = fake_pynvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sampler = SystemSampler()
    assert sampler.source == "rss" and set(sampler.take()) == {"rss_gib"}
    assert sampler.nvml_error == "no GPU of CUDA_VISIBLE_DEVICES found through NVML" and nv.shutdowns == 1


def test_step_profiler_traces_only_its_steps(tmp_path):
    prof = StepProfiler(start=2, steps=2, out=tmp_path, rank=3, device=torch.device("cpu"))
    x = torch.ones(8, 8)
    for step in range(1, 6):
        prof.before(step)
        torch.mm(x, x)
        prof.after(step)
    trace = json.loads((tmp_path / "profile" / "rank3.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2
    assert names.count("aten::mm") == 2  # steps 2 and 3 only
    assert prof.close() is None  # written once


@pytest.mark.parametrize("override, message", [
    ("log.profile={start: 0}", "log.profile.start"),
    ("log.profile={steps: 2}", "log.profile.start"),
    ("log.profile={start: 2, step: 2}", "log.profile.step"),
    ("log.system=sometimes", "log.system"),
])
def test_monitor_keys_are_typed(override, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(BASE, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_profile_key_parses():
    cfg = config_from_dict(BASE, ["log.profile={start: 3, steps: 2}"])
    assert (cfg.log.profile.start, cfg.log.profile.steps) == (3, 2)
    assert config_from_dict(BASE).log.profile is None


def test_log_comm_false_installs_no_counter(tmp_path, cli):
    """log.comm=false: no collective is counted (summary's comm counts no step); on by default (tests/dist)."""
    from conftest import MICRO, ROOT

    out = tmp_path / "run"
    proc = cli("train", str(ROOT / "examples" / "tiny.yaml"), MICRO, "--nproc", "1", "train.max_steps=2",
               "log.report=false", "log.comm=false", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["comm"]["steps"] == 0


def test_profiler_keeps_the_collectives_of_its_steps_only(tmp_path):
    prof = StepProfiler(start=2, steps=2, out=tmp_path, rank=0, device=torch.device("cpu"))
    for step in range(1, 5):
        prof.add_comm(step, {"all_gather": {"calls": 1, "bytes": 10.0 * step, "bus_bytes": 5.0 * step}})
    assert prof.comm == {"all_gather": {"calls": 2, "bytes": 50.0, "bus_bytes": 25.0}}
    assert prof.take_fields() == {}  # no GPU trace, no bandwidth (tests/unit/test_comm_kernels.py, tests/gpu)
