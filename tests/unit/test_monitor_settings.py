"""The system sampler without NVML (this machine has no GPU and no nvidia-ml-py), the step profiler on CPU, and
their config keys."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from shardtune.config import ConfigError, config_from_dict
from shardtune.metrics.profile import StepProfiler
from shardtune.metrics.system import SystemSampler

BASE = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "x.jsonl"}}


def test_sampler_without_nvml_reports_the_process_rss_and_stops():
    sampler = SystemSampler(period_s=0.01).start()
    assert sampler.source == "rss"
    record = sampler.take()
    assert set(record) == {"rss_gib"} and record["rss_gib"] > 0
    sampler.close()
    assert not any(t.name == "shardtune-system-sampler" for t in threading.enumerate())


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
