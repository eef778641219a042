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
    # Writing the trace after step 3 is left out of step 4's tokens/s and logged as trace_s, on that record only.
    traced = {r["step"]: r.get("trace_s") for r in _train_records(out)}
    assert traced[4] > 0 and all(v is None for step, v in traced.items() if step != 4), traced


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


def _train_records(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if not r.get("eval") and "loss" in r]


def test_mlflow_run_holds_every_logged_loss_and_the_config(two, monkeypatch):
    """log.mlflow (the zero3 variant, a file store): MLflow's own client reads back one run named after the output
    folder, each train record's loss at its step, and the config as dotted parameters."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run had it (conftest's fsdp2_runs)
    out = Path(two["zero3"]["output_dir"])
    client = MlflowClient(tracking_uri=f"file://{out.parent / 'mlruns'}")
    runs = client.search_runs([client.get_experiment_by_name("shardtune-tests").experiment_id])
    assert [r.info.run_name for r in runs] == [out.name]
    history = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    assert history == pytest.approx({r["step"]: r["loss"] for r in _train_records(out)}, rel=1e-6)
    assert runs[0].data.params["parallel.strategy"] == "zero3"


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log framing in 32 KiB blocks
    (checksum 4, length 2, type 1: full, or first / middle / last pieces). wandb >= 0.19 no longer ships a Python
    reader; its records are wandb_internal_pb2.Record messages."""
    data, records, pending, pos, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            continue
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            records.append(pending)
    return records


def test_wandb_offline_run_holds_every_logged_loss(two):
    """log.wandb with mode offline (the zero3 variant): the run's transaction log under OUTPUT_DIR/wandb, parsed
    with wandb's own protobuf messages, holds each train record's loss at its step and the config."""
    from wandb.proto import wandb_internal_pb2

    out = Path(two["zero3"]["output_dir"])
    [log] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for raw in _wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":  # each item named by its key path (nested_key), the step in its own field
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                history[record.history.step.num] = items["train/loss"]
        elif kind == "run":  # wandb.init's config
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    assert history == pytest.approx({r["step"]: r["loss"] for r in _train_records(out)}, rel=1e-6)
    assert config["parallel"]["strategy"] == "zero3"
