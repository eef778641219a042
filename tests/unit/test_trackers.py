"""Trackers (metrics/trackers.py): which numbers of a record they get, and the refusal of one that is configured
but not installed or does not start. What TensorBoard, W&B (offline) and MLflow (a file store) received from a
real run is read back in tests/dist/test_monitors.py."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import MICRO, ROOT, one_line_error, shardtune

from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.metrics.trackers import _flat, configured, make_trackers, scalars

TINY = str(ROOT / "examples" / "tiny.yaml")


def test_a_record_becomes_train_or_eval_scalars():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": None, "grad_norm": math.nan, "skipped_steps": 0,
              "peak_mem_gib_ranks": [1.0, 1.1], "variant": "x", "eval": False, "stopped": True}
    assert scalars(record) == {"train/loss": 2.5, "train/lr": 1e-3, "train/skipped_steps": 0.0}
    assert scalars({"step": 3, "eval": True, "eval_loss": 1.5}) == {"eval/eval_loss": 1.5}


def test_the_keys_and_what_they_turn_on():
    cfg = load_config(TINY, ["log.tensorboard=true", "log.wandb={project: p, mode: offline}",
                             "log.mlflow={experiment: e}"])
    assert configured(cfg.log) == ["tensorboard", "wandb", "mlflow"]
    assert cfg.log.wandb.mode == "offline" and cfg.log.mlflow.tracking_uri is None
    assert configured(load_config(TINY, []).log) == []
    assert _flat({"a": {"b": 1, "c": {"d": "x" * 600}}}) == {"a.b": "1", "a.c.d": "x" * 500}


@pytest.mark.parametrize("key, value", [("wandb", "{project: p}"), ("mlflow", "{experiment: e}")])
def test_a_tracker_that_is_not_installed_is_refused_in_one_line(cli, monkeypatch, key, value):
    # CI installs both; None in sys.modules is Python's own way to make a module unimportable (find_spec: None).
    monkeypatch.setitem(sys.modules, key, None)
    one_line_error(cli("validate", TINY, f"log.{key}={value}"), f"log.{key}: the {key} package is not installed",
                   f"pip install {key}")


def test_a_tracker_that_does_not_start_stops_the_run_in_one_line(tmp_path):
    """Installed but not starting (here MLflow, the real package, given a tracking URI it has no store for): one
    line naming the tracker and MLflow's own reason, before any training."""
    cfg = load_config(TINY, ["log.mlflow={experiment: e, tracking_uri: 'nosuch://host/x'}"])
    with pytest.raises(ShardtuneError) as err:
        make_trackers(cfg.log, tmp_path, {})
    message = str(err.value)
    assert message.startswith("log.mlflow: mlflow did not start: ") and "nosuch" in message, message
    assert "\n" not in message


def test_a_run_whose_tracker_does_not_start_exits_2_in_one_line(tmp_path, data_cache):
    """The same through the real `shardtune train` on 2 processes (a subprocess: torch's launcher logs to the
    stderr it found first): rank 0 makes the trackers; the run stops at its start with the tracker's line, exit 2,
    no traceback (rank 1, waiting in a collective, is ended by the launcher)."""
    proc = shardtune("train", TINY, MICRO, "--nproc", "2", "--output-dir", str(tmp_path / "run"),
                     "train.max_steps=2", f"data.cache_dir={data_cache}",
                     "log.mlflow={experiment: e, tracking_uri: 'nosuch://host/x'}")
    # Workers print their libraries' warnings too (as in test_run_safety): one error line among them.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: log.mlflow: mlflow did not start: "), proc.stderr
    assert "nosuch" in errors[0]
