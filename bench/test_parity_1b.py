"""Tests of bench/parity_1b.py's comparison (pure Python; `pytest bench/`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import parity_1b


def test_a_trajectory_within_the_bounds_passes_and_one_step_off_fails():
    ref = [10.0 - 0.1 * i for i in range(50)]
    near = [x * (1 + 0.004) for x in ref]
    bound = parity_1b.BOUNDS["bf16"]
    assert parity_1b.compare(ref, near, bound)["ok"]
    jump = list(near)
    jump[30] *= 1.03  # one step 3% off: past the every-step bound
    got = parity_1b.compare(ref, jump, bound)
    assert not got["ok"] and got["max_at"] == 31
    drift = [x * (1 + 0.015 * i / 49) for i, x in enumerate(ref)]  # every step within 2%, the last ten ~1.4% high
    assert not parity_1b.compare(ref, drift, bound)["ok"]


def test_a_run_that_stopped_early_or_logged_nothing_fails():
    ref = [5.0] * 50
    assert not parity_1b.compare(ref, ref[:40], parity_1b.BOUNDS["bf16"])["ok"]
    assert parity_1b.compare(ref, [], parity_1b.BOUNDS["bf16"]) == {"steps": 0, "ok": False}


def test_float8_rows_get_the_float8_bounds():
    assert parity_1b.bounds("f", ["parallel.compile=true", parity_1b.F8], "bf16") == parity_1b.BOUNDS["float8"]
    assert parity_1b.bounds("c", ["parallel.compile=true"], "bf16") == parity_1b.BOUNDS["bf16"]


def test_losses_are_read_in_step_order_without_evaluations(tmp_path):
    rows = [{"step": 2, "loss": 4.0}, {"eval": True, "step": 2, "eval_loss": 3.0}, {"step": 1, "loss": 5.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert parity_1b.losses_of(tmp_path) == [5.0, 4.0]
    assert parity_1b.losses_of(tmp_path / "missing") == []


def test_a_row_passes_only_when_it_ran_applied_and_stayed_within():
    ok_cmp = {"steps": 50, "ok": True}
    row = {"name": "liger_loss", "rc": 0, "cmp": ok_cmp, "applied": True, "tail": []}
    assert parity_1b.verdict(row, ref_ok=True) == (True, "yes")
    assert not parity_1b.verdict(row, ref_ok=False)[0]  # no full reference: nothing passes
    assert not parity_1b.verdict({**row, "rc": 2, "tail": ["error: model.liger: loss needs CUDA GPUs"]}, True)[0]
    passed, word = parity_1b.verdict({**row, "applied": False}, True)
    assert not passed and "NOT APPLIED" in word


def test_the_control_must_fall_outside_the_bounds():
    control = {"name": parity_1b.CONTROL, "rc": 0, "applied": True, "tail": []}
    assert parity_1b.verdict({**control, "cmp": {"steps": 50, "ok": False}}, True) == (True, "differs (as it must)")
    passed, word = parity_1b.verdict({**control, "cmp": {"steps": 50, "ok": True}}, True)
    assert not passed and "cannot tell" in word
    assert all(parity_1b.CONTROL in variants for variants in parity_1b.VARIANTS.values())
