"""bench/long_context.py's runs through the real CLI (tiny Llama on CPU; `pytest bench/`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import long_context
import make_long_text


def test_a_run_into_a_folder_holding_an_earlier_finished_run_reports_its_own_numbers(tmp_path: Path) -> None:
    """Call 114 reused a run's folder: the CLI refused it (a finished run was there) and the script read the earlier
    run's metrics as the new one's. Each run now starts in a fresh folder."""
    args = argparse.Namespace(work=str(tmp_path), preset="tiny-llama", positions=131072, steps=1, timeout=300.0)
    stale = tmp_path / "plain-64"
    stale.mkdir()
    (stale / "summary.json").write_text(json.dumps({"exit_code": 0, "steps": 2}))
    (stale / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens_per_sec_per_device": 123456.0,
                                                     "peak_mem_gib": 99.0}) + "\n")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_long_text.make_lines(4, 400, 0, 65)))
    with open(tmp_path / "log.txt", "w") as log:
        row = long_context.shardtune_run("plain", 64, args, data, log)
    assert row["rc"] == 0, row["tail"]
    assert row["steps"] == 1 and row["tokens_per_s"] != 123456.0 and row["peak_gib"] < 99.0
    assert len(row["step_s"]) == len(row["gc_s"]) == len(row["alloc_retries"]) == 1 and row["recompiles"] == 0
