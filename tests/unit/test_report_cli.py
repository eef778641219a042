"""`shardtune report`'s refusals (exit 2, one line) and its config key. The pictures themselves are checked from
real runs in tests/dist/test_report.py; the top section's paths from a run directory made here."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, one_line_error

from shardtune.config import ConfigError, config_from_dict, dump_config, load_config
from shardtune.report import checkpoints_dir, read_run, write_report


def test_report_refuses_a_missing_directory(tmp_path, cli):
    one_line_error(cli("report", str(tmp_path / "nope")), "is not a directory")


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    one_line_error(cli("report", str(tmp_path / "empty")), "has no metrics.jsonl", "train.output_dir")
    assert not (tmp_path / "empty" / "report").exists()


def test_log_report_is_a_typed_key():
    base = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "x.jsonl"}}
    assert config_from_dict(base).log.report is True
    with pytest.raises(ConfigError, match=r"log\.report: 'maybe' is not valid"):
        config_from_dict(base, ["log.report=maybe"])


def _run_dir(path, overrides):
    """A run directory as `train` leaves it, cut to what the report's top section reads: config.yaml written by
    dump_config (as the loop writes it), one metrics record and a summary."""
    path.mkdir(parents=True)
    cfg = load_config(ROOT / "examples" / "tiny.yaml", [f"train.output_dir={path}", *overrides])
    (path / "config.yaml").write_text(dump_config(cfg))
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (path / "summary.json").write_text(json.dumps({"model_dir": str(path / "model"), "steps": 1}))
    return path


def test_the_report_shows_where_the_checkpoints_went(tmp_path):
    """checkpoint.dir elsewhere: that folder; unset: RUN/checkpoints, also for a run folder moved since."""
    elsewhere = tmp_path / "scratch" / "ckpts"
    run = _run_dir(tmp_path / "run", [f"checkpoint.dir={elsewhere}"])
    page = write_report([run], tmp_path / "report").read_text()
    assert f"<th>checkpoints</th><td>{elsewhere}</td>" in page, page
    assert f"<th>model</th><td>{run / 'model'}</td>" in page
    default = _run_dir(tmp_path / "plain", [])
    moved = default.rename(tmp_path / "moved")
    page = write_report([moved], tmp_path / "report2").read_text()
    assert f"<th>checkpoints</th><td>{moved / 'checkpoints'}</td>" in page
    (moved / "config.yaml").write_text("checkpoint: [unclosed\n")  # a file cut short: the default, no error
    assert checkpoints_dir(read_run(moved)) == moved / "checkpoints"
