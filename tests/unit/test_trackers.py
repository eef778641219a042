"""Trackers (metrics/trackers.py): which numbers of a record they get, and the refusal of one that is configured
but not installed. TensorBoard's event files from a real run are read in tests/dist/test_monitors.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
from conftest import ROOT, one_line_error

from shardtune.config import load_config
from shardtune.metrics.trackers import _flat, configured, scalars

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
def test_a_tracker_that_is_not_installed_is_refused_in_one_line(cli, key, value):
    if importlib.util.find_spec(key) is not None:
        pytest.skip(f"{key} is installed here")
    one_line_error(cli("validate", TINY, f"log.{key}={value}"), f"log.{key}: the {key} package is not installed",
                   f"pip install {key}")
