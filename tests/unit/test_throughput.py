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

from shardtune.checkpoint.runlock import release_run_dir
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
        release_run_dir(tmp / "run")  # run_training took the run-dir lock for this process, as rank 0 does
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


def test_records_say_where_a_steps_time_went(slow_eval_run):
    out, _ = slow_eval_run
    for r in (r for r in _records(out) if not r.get("eval")):
        # On a CPU every op runs as the host issues it: the host's time is nearly all of the step, with the
        # evaluation left out of both (counted in host_s, the step with the evaluation would exceed its step time)
        assert 0.8 * r["step_time_s"] < r["host_s"] <= r["step_time_s"], r
        # the loop collects after every step (a collection runs each time); both per step, as host_s
        assert 0.0 < r["data_s"] < r["host_s"] and 0.0 < r["gc_s"] < r["host_s"], r
        assert "alloc_retries" not in r  # CUDA's caching allocator only


def test_the_start_says_how_much_of_the_held_out_set_each_evaluation_runs(slow_eval_run):
    _, err = slow_eval_run
    # 300 held-out examples, 50 micro-batches of 4 on 1 process.
    assert "eval: the first 200 of 300 held-out examples each time (train.eval_batches=50" in err, err


@pytest.mark.parametrize("setting, eval_every, grad_accum, steps, cap", [
    ("auto", 0, 1, 30, 15),  # a 30-step run evaluates 15 micro-batches per process, not 1,000 examples
    ("auto", 0, 1, 1, 1),
    ("auto", 100, 2, 300, 100),
    ("auto", 100, 2, 4, 4),  # shorter than eval_every: evaluated at its start and end, 4 steps apart
    ("auto", 0, 4, 7, 14),
    (8, 0, 1, 30, 8),
])
def test_eval_batches_auto_is_sized_to_the_run(setting, eval_every, grad_accum, steps, cap):
    from shardtune.config import TrainConfig
    from shardtune.train.loop import eval_batch_cap

    t = TrainConfig(eval_batches=setting, eval_every=eval_every, grad_accum=grad_accum)
    assert eval_batch_cap(t, steps) == cap


@pytest.mark.parametrize("value", ["all", None])
def test_eval_batches_all_or_null_evaluates_everything(value):
    from shardtune.config import TrainConfig
    from shardtune.train.loop import eval_batch_cap

    assert eval_batch_cap(TrainConfig(eval_batches=value), 30) >= 10**9
    assert TrainConfig().eval_batches == "auto"


def test_eval_batches_refuses_other_words(tmp_path):
    from shardtune.config import load_config
    from shardtune.errors import ConfigError

    with pytest.raises(ConfigError, match="eval_batches"):
        load_config(TINY, ["train.eval_batches=some"])


def test_the_run_ends_with_its_throughput_line_and_summary(slow_eval_run):
    out, err = slow_eval_run
    last = {r["step"]: r for r in _records(out) if not r.get("eval")}[8]  # the first interval (warm-up) is left out
    t = json.loads((out / "summary.json").read_text())["throughput"]
    assert t["tokens_per_sec"] == last["tokens_per_sec"] and t["intervals"] == 1 and t["from_step"] == 8
    assert t["mfu"] is None and t["peak_mem_gib"] > 0  # no MFU without a GPU's peak
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"throughput: {last['tokens_per_sec']:,.0f} tokens/s ("), lines[-1]
    assert "GiB (host RSS)" in lines[-1] and "without evaluation and checkpoint time" in lines[-1]


def test_the_run_ends_with_a_summary_of_its_scores_and_files(slow_eval_run):
    """The line before the throughput line: steps and time, the final train loss, eval loss and exact match,
    and where the checkpoints are (save_final=false here: no model line); the first evaluation line says what
    exact match means, the later ones do not repeat it."""
    out, err = slow_eval_run
    records = _records(out)
    train = [r for r in records if not r.get("eval") and "loss" in r]
    final_eval = [r for r in records if r.get("eval")][-1]
    done = err.strip().splitlines()[-2]
    assert done.startswith("done: 8 steps in "), done
    assert (f"; train loss {train[-1]['loss']:.4f}, eval loss {final_eval['eval_loss']:.4f}, exact match "
            f"{final_eval['eval_accuracy']:.1%}; checkpoints in {out / 'checkpoints'} (newest step-00000008)") in done
    assert "model in" not in done
    evals = [line for line in err.splitlines() if ": eval loss " in line]
    assert evals[0].startswith("step 0: eval loss ") and "greedy choice" in evals[0]
    assert len(evals) >= 2 and not any("greedy" in line for line in evals[1:])


def test_the_throughput_line_on_a_gpu_shows_mfu_and_both_peaks():
    from shardtune.train.loop import throughput, throughput_line

    history = [{"step": s, "tokens_per_sec": tps, "tokens_per_sec_per_device": tps, "mfu": m, "peak_mem_gib": mem,
                "peak_reserved_gib": mem + 3, "step_time_s": 0.1}
               for s, tps, m, mem in [(5, 1000.0, 0.1, 20.0), (10, 52800.0, 0.5, 27.1), (15, 52000.0, 0.49, 26.0),
                                      (20, 53000.0, 0.51, 26.0)]]
    line = throughput_line(throughput(history), "cuda")
    assert line.startswith("throughput: 52,800 tokens/s (52,800 per device, 52,000-53,000), MFU 50.0%, "
                           "peak memory 27.1 GiB allocated, 30.1 GiB reserved; median of 3 logged intervals "
                           "from step 10"), line
    # each record is its interval's own peak on a GPU: where the first interval (compile) held the most, the line
    # gives the steady steps' peak beside the run's
    history[0]["peak_mem_gib"] = 27.6
    t = throughput(history)
    assert (t["peak_mem_gib"], t["steady_peak_mem_gib"]) == (27.6, 27.1)
    assert "peak memory 27.6 GiB allocated (27.1 from step 10), 30.1 GiB reserved;" in throughput_line(t, "cuda")
    assert "(27.1 from" not in throughput_line(t, "cpu")  # RSS only grows: no steady peak of its own


def test_allocator_retries_are_the_intervals_own_and_summed_over_ranks(monkeypatch):
    # The caching allocator's retry counter only grows over a run; each record carries the retries of its own
    # interval, and on several processes the sum with each rank's count (the rank near its memory limit).
    from shardtune.dist import DistContext
    from shardtune.train import loop

    counter = iter([3, 3, 5, 5])  # at the interval's start, then at three flushes
    monkeypatch.setattr(loop, "_alloc_retries", lambda device: next(counter))
    cpu = torch.device("cpu")
    interval = loop._Interval(cpu)
    ctx = DistContext(0, 1, 0, cpu)
    records = []
    for step in (1, 2, 3):
        interval.add(torch.tensor(1.0), 8)
        records.append(interval.flush(step, 1e-3, torch.tensor(1.0), 1.0, None, ctx))
    assert [r.get("alloc_retries") for r in records] == [None, 2, None]
    assert "alloc_retries_ranks" not in records[1]
    assert loop._retries_fields([0, 0]) == {}
    assert loop._retries_fields([0, 4, 1]) == {"alloc_retries": 5, "alloc_retries_ranks": [0, 4, 1]}


def _flush_as_rank(rank: int, store: str, out: str) -> None:
    import os

    import torch.distributed as dist

    from shardtune.dist import DistContext
    from shardtune.train import loop

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    interval = loop._Interval(cpu)
    interval.data_s = 0.4 if rank == 1 else 0.1  # rank 1 built its batches slowly
    for _ in range(2):
        interval.add(torch.tensor(1.0), 8)
    record = interval.flush(2, 1e-3, torch.tensor(1.0), 1.0, None, DistContext(rank, 2, rank, cpu))
    Path(out, f"{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    os._exit(0)  # no gloo teardown at interpreter exit (pytorch/pytorch#179291)


def test_records_carry_the_slowest_ranks_batch_time(tmp_path):
    # Real gloo group of two processes: each rank's record says the slowest rank's batch-building time per step
    # (every rank waits for it at the step's first collective), the same on every rank.
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_flush_as_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, p.exitcode
    records = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [r["data_s"] for r in records] == [pytest.approx(0.2), pytest.approx(0.2)]
    assert all(len(r["peak_mem_gib_ranks"]) == 2 and "alloc_retries" not in r for r in records)
