"""`shardtune report`'s refusals (exit 2, one line) and its config key. The pictures themselves are checked from
real runs in tests/dist/test_report.py."""

from __future__ import annotations

import pytest
from conftest import one_line_error

from shardtune.config import ConfigError, config_from_dict


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
