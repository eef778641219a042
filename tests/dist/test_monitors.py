"""The loop's monitors on 2 gloo processes (the session's FSDP2 launch, tests/conftest.py `fsdp2_runs`): each
rank's peak memory in metrics.jsonl, the system sampler's record without NVML, and `log.profile`'s trace per
rank (the zero3 variant traces steps 2-3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two(fsdp2_runs):
    return fsdp2_runs[1]


def test_memory_per_rank_and_process_rss_are_logged(two):
    logged = two["zero2"]["logged"]
    allocated, reserved = logged["peak_mem_gib_ranks"], logged["peak_reserved_gib_ranks"]
    assert len(allocated) == len(reserved) == 2 and min(allocated) > 0
    assert logged["peak_mem_gib"] == max(allocated)  # the max over ranks, as before
    assert logged["rss_gib"] > 0  # no NVML here: the process's resident set instead of GPU samples
    assert not any(k.startswith("gpu_") for k in logged)


def test_profile_writes_a_chrome_trace_per_rank_for_the_chosen_steps(two):
    out = Path(two["zero3"]["output_dir"])
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"rank{rank}.json").read_text())
        names = [e.get("name", "") for e in trace["traceEvents"]]
        assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # steps 2 and 3, one span each
        assert any(n.startswith("aten::") for n in names)
        table = (out / "profile" / f"rank{rank}.txt").read_text()  # the ops by time, beside the trace
        assert table.startswith("steps 2-3, by self_cpu_time_total") and "aten::mm" in table, table
    assert not (Path(two["zero2"]["output_dir"]) / "profile").exists()  # off unless log.profile is set


def test_tensorboard_events_hold_every_logged_number(two):
    """log.tensorboard (the zero3 variant): rank 0's event file, read with TensorBoard's own reader, holds each
    metrics.jsonl train record's loss and grad norm at its step, the evaluations as eval/*, and the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = Path(two["zero3"]["output_dir"])
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval") and "loss" in r]
    evals = [r for r in records if r.get("eval")]
    assert train and evals
    for key in ("loss", "grad_norm"):
        got = {e.step: e.value for e in events.Scalars(f"train/{key}")}
        assert got == pytest.approx({r["step"]: r[key] for r in train}, rel=1e-6)
    got = {e.step: e.value for e in events.Scalars("eval/eval_loss")}
    assert got == pytest.approx({r["step"]: r["eval_loss"] for r in evals}, rel=1e-6)
    assert "config/text_summary" in events.Tags()["tensors"]
    assert not (Path(two["zero2"]["output_dir"]) / "tensorboard").exists()  # off unless log.tensorboard is set
