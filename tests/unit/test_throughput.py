"""What a run reports about its speed: tokens/s and MFU count training time only (an evaluation inside a
logged interval does not slow the record down), and the run ends with one line of the numbers that matter.

One real 1-process training run (in this process, gloo group of 1) whose evaluation is made slow on
purpose: 50 eval micro-batches (forwards) against 4 training steps per logged interval."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from shardtune.config import load_config
from shardtune.train.loop import run_training

TINY = str(ROOT / "examples" / "tiny.yaml")
EVERY = 4  # log.every
EVAL_AT = 6  # the evaluation falls inside the interval logged at step 8


@pytest.fixture(scope="module")
def slow_eval_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("throughput")
    rows = (ROOT / "examples" / "data" / "tasks.jsonl").read_text().splitlines()[:600]
    (tmp / "rows.jsonl").write_text("\n".join(rows) + "\n")
    cfg = load_config(TINY, [f"data.train_file={tmp / 'rows.jsonl'}", "data.eval_fraction=0.5",
                             f"data.cache_dir={tmp / 'cache'}", f"train.output_dir={tmp / 'run'}",
                             "train.micro_batch_size=4", "train.max_steps=8", f"train.eval_every={EVAL_AT}",
                             "train.eval_batches=50", f"log.every={EVERY}", "log.progress=false",
                             "checkpoint.save_final=false", "parallel.nproc=1"])
    err = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's workers run (OMP_NUM_THREADS=1): 2 threads crawl on a busy machine
    try:
        with contextlib.redirect_stderr(err):
            run_training(cfg)
    finally:
        torch.set_num_threads(threads)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return tmp / "run", err.getvalue()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tokens_per_sec_leaves_out_the_evaluation_inside_an_interval(slow_eval_run):
    out, _ = slow_eval_run
    steps = {r["step"]: r for r in _records(out) if not r.get("eval")}
    assert sorted(steps) == [4, 8]
    before, with_eval = steps[4], steps[8]
    assert "eval_s" not in before and with_eval["eval_s"] > 0
    train_s = with_eval["step_time_s"] * EVERY
    # Counted as training time, the evaluation alone would make the interval's time longer than eval_s; it is
    # shorter because the evaluation (50 forwards) takes longer than 4 training steps and is left out.
    assert train_s < with_eval["eval_s"], (train_s, with_eval)
    # tokens/s (and MFU, computed from it) describe the same training seconds as step_time_s: about as many
    # tokens in each interval of 4 steps of 4 sequences.
    tokens = [r["tokens_per_sec"] * r["step_time_s"] * EVERY for r in (before, with_eval)]
    assert tokens[1] == pytest.approx(tokens[0], rel=0.3), tokens
