"""Fit the planner's step-efficiency constants (plan/speed.py: EFF_MAX, EFF_H0, EFF_X0) to the measured rows.

    python3 bench/fit_speed.py            # the fit on the rows the constants were fitted to, and the error on all

The rows are bench/planner_accuracy_*.jsonl (one H200). The fit set is the 13 rows of calls 14-15 that run without
offload (as on 2026-12-01); every other row is held out. For each (EFF_H0, EFF_X0) on a grid, EFF_MAX is the
value that makes the mean log error of the fit set zero; the pair with the least rms log error wins. Prints the
fitted constants, the rms on the fit set and on all rows, and the rows off by more than 15%.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from shardtune.config import load_config
from shardtune.models.build import load_hf_config
from shardtune.plan import predict_run, speed
from shardtune.plan.hardware import lookup

ROOT = Path(__file__).resolve().parent.parent
# The attention rate (speed.ATTN_EFF) is fitted on these; the longer rows of calls 35-36 are held out.
LONG_FIT = ("8b-qlora-long-plain-131072", "8b-qlora-long-offload-131072")


def rows() -> list[tuple[dict, object, object]]:
    """(row, config, hf config) for every measured run that ran as configured."""
    spec = importlib.util.spec_from_file_location("planner_accuracy", ROOT / "bench" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    matrix = {name: overrides for rs in module.MATRICES.values() for name, _, overrides in rs}
    out = []
    for path in sorted((ROOT / "bench").glob("planner_accuracy_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if not row.get("meas_tps"):
                continue
            overrides = row.get("overrides") or matrix[row["name"]]
            cfg = load_config(str(ROOT / "bench" / "bench.yaml"),
                              ["data.train_file=examples/data/tasks.jsonl", *overrides])
            if "auto" in (cfg.parallel.strategy, cfg.train.micro_batch_size):
                continue
            out.append((row, cfg, load_hf_config(cfg.model)))
    return out


def log_errors(data: list, h200) -> list[float]:
    return [math.log(predict_run(cfg, hf, h200, world=1, per_node=1).time.tokens_per_sec_per_gpu / row["meas_tps"])
            for row, cfg, hf in data]


def main() -> int:
    h200, data = lookup("h200"), rows()
    fit = [d for d in data if d[0]["call"] in (14, 15) and "oo" not in d[0]["name"]]
    best = None
    for h0 in (300.0, 500.0, 700.0, 900.0, 1200.0):
        for x0 in (1.0e6, 1.5e6, 2.0e6, 2.5e6, 3.0e6, 4.0e6):
            speed.EFF_H0, speed.EFF_X0, speed.EFF_MAX = h0, x0, 1.0
            errors = log_errors(fit, h200)
            mean = sum(errors) / len(errors)
            rms = math.sqrt(sum((e - mean) ** 2 for e in errors) / len(errors))
            # EFF_MAX scales every prediction: exp(-mean) zeroes the mean log error.
            if best is None or rms < best[0]:
                best = (rms, h0, x0, math.exp(-mean))
    rms, speed.EFF_H0, speed.EFF_X0, speed.EFF_MAX = best
    long = [d for d in data if d[0]["name"] in LONG_FIT]
    for _ in range(3):  # the attention rate on the long rows, the GEMM constants again with it
        speed.ATTN_EFF *= math.exp(-sum(log_errors(long, h200)) / len(long))
        errors = log_errors(fit, h200)
        speed.EFF_MAX *= math.exp(-sum(errors) / len(errors))
    print(f"ATTN_EFF {speed.ATTN_EFF:.3f} (fitted on {len(long)} rows at 131,072 tokens), EFF_MAX then "
          f"{speed.EFF_MAX:.3f}")
    every = log_errors(data, h200)
    print(f"fit set: {len(fit)} rows; EFF_MAX {speed.EFF_MAX:.3f}, EFF_H0 {speed.EFF_H0:.0f}, EFF_X0 "
          f"{speed.EFF_X0:.2g}; rms log error {rms:.3f}")
    print(f"all {len(data)} rows: rms log error {math.sqrt(sum(e * e for e in every) / len(every)):.3f}; "
          f"within 15%: {sum(abs(math.exp(e) - 1) <= 0.15 for e in every)}")
    for (row, _, _), e in zip(data, every, strict=True):
        if abs(math.exp(e) - 1) > 0.15 or "long" in row["name"]:
            print(f"  {row['call']} {row['name']}: {math.exp(e) - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
