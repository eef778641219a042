"""A run's safety nets through the real CLI: one run per output directory (the lock), numerical faults
(non-finite loss or gradient norm: skip, count, stop with a checkpoint after N in a row), and a full disk."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MICRO, ROOT, _env, descendants, run_cli, small_tmpfs

from shardtune.checkpoint.export import checkpoint_tensors
from shardtune.checkpoint.layout import complete_checkpoints, resolve_checkpoint
from shardtune.checkpoint.runlock import LOCK, lock_run_dir, release_run_dir
from shardtune.train.loop import TEST_NAN_ENV as NAN_ENV
from shardtune.train.loop import TEST_OOM_ENV as OOM_ENV
from shardtune.train.loop import TEST_SIGKILL_ENV

pytestmark = pytest.mark.dist

TINY = str(ROOT / "examples" / "tiny.yaml")
STEPS = 20  # the first run is frozen (SIGSTOP) while the second one is tried, so it need not be long


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", TINY, "--nproc", "1", "--output-dir", str(out), "train.micro_batch_size=4", "log.every=1",
            "log.progress=false", "train.eval_every=0", "train.eval_batches=1", f"data.cache_dir={cache}",
            "log.report=false", *extra]


def test_a_second_run_into_the_same_output_dir_is_refused_while_the_first_runs(tmp_path, cli, cache):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "shardtune", *_args(out, cache, f"train.max_steps={STEPS}")],
                             cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run never logged a step"
            time.sleep(0.2)
        # Freeze the first run (launcher and worker) mid-training: it holds the lock however slow this machine is.
        frozen = descendants(first.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        second = cli(*_args(out, cache, "train.max_steps=2"))
        assert first.poll() is None, "the first run ended before the second one was tried"
    except BaseException:
        first.kill()
        first.wait()
        raise
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out} is in use by another shardtune run (pid {first.pid} on host ")
    assert "another --output-dir" in line
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == list(range(1, STEPS + 1))  # the second run wrote nothing there
    # The lock died with its process: the next run (here: this process) takes it.
    lock_run_dir(out)
    release_run_dir(out)
    assert (out / LOCK).is_file()
    _refuses_the_finished_run_unless_resumed_or_overwritten(out, cache, cli)


def _refuses_the_finished_run_unless_resumed_or_overwritten(out: Path, cache: Path, cli) -> None:
    """Once the first run has finished, a new run in its folder would write over its metrics, checkpoints and
    summary: refused in one line, nothing touched; --overwrite starts again there from step 0, with the old
    run's checkpoints removed so --resume auto and keep_last see only the new run's."""
    before = {p: (out / p).read_bytes() for p in ("metrics.jsonl", "summary.json")}
    old_checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    again = cli(*_args(out, cache, "train.max_steps=2"))
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: train.output_dir: {str(out)!r} holds a finished run ({STEPS} steps")
    assert "--resume auto" in line and "--overwrite" in line
    assert {p: (out / p).read_bytes() for p in before} == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == old_checkpoints
    fresh = cli(*_args(out, cache, "train.max_steps=2", "--overwrite"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "--overwrite: removed the finished run's summary and checkpoints" in fresh.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    new_checkpoints = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")]
    assert new_checkpoints == ["step-00000002"] and f"step-{STEPS:08d}" in old_checkpoints


def _launch(*args: str, nan_steps: str):
    return run_cli(*args, env={NAN_ENV: nan_steps})


def _records(out: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return {name: t.load() for name, t in checkpoint_tensors(step_dir).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_step_is_skipped_and_the_run_goes_on(tmp_path, precision):
    """fp32: FSDP2 on the one process; bf16: the one-GPU default for full fine-tuning (parallel.one_gpu: direct),
    whose fp32 masters and their compute-dtype copies must both stay as the step before left them."""
    out = tmp_path / "run"
    proc = _launch(*_args(out, tmp_path / "cache", MICRO, "train.max_steps=5", "checkpoint.every_steps=1",
                          "checkpoint.keep_last=5", f"train.precision={precision}"), nan_steps="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 3: non-finite loss or gradient norm; update skipped" in proc.stderr
    records = _records(out)
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5))
    ckpts = out / "checkpoints"
    # Step 3 left model (and optimizer) as step 2 wrote them: the same as a run without that update.
    assert _same(_weights(ckpts / "step-00000002"), _weights(ckpts / "step-00000003"))
    assert not _same(_weights(ckpts / "step-00000003"), _weights(ckpts / "step-00000004"))
    assert (out / "model" / "model.safetensors").is_file()


def test_max_bad_steps_in_a_row_stop_with_a_checkpoint_of_the_last_good_weights(tmp_path):
    out = tmp_path / "run"
    proc = _launch(*_args(out, tmp_path / "cache", MICRO, "train.max_steps=8", "train.max_bad_steps=3",
                          "checkpoint.every_steps=1", "checkpoint.keep_last=8", "--nproc", "2"),
                   nan_steps="2,3,4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(error) == 1 and "step 4: 3 steps in a row had a non-finite loss" in error[0]
    assert "train.max_bad_steps=3" in error[0] and "--resume auto" in error[0]
    ckpts = out / "checkpoints"
    assert resolve_checkpoint("auto", ckpts, check=True) == ckpts / "step-00000004"
    assert _same(_weights(ckpts / "step-00000001"), _weights(ckpts / "step-00000004"))
    assert not (ckpts / "step-00000005").exists() and not (out / "model").exists()


def test_non_finite_weights_are_never_saved(tmp_path):
    out = tmp_path / "run"
    proc = _launch(*_args(out, tmp_path / "cache", MICRO, "train.max_steps=3", "train.skip_nonfinite=false",
                          "checkpoint.at_end=false"), nan_steps="2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: step 3: the weights hold NaN or Inf values; no model was written" in proc.stderr
    assert not (out / "model").exists() and not (out / "checkpoints").exists()


def test_out_of_gpu_memory_is_one_line_with_the_fixes(tmp_path):
    """A CUDA out-of-memory error (raised here by the loop's test hook: a CPU cannot run out of GPU memory) ends
    the run with exit code 2 and one line: where, and the smallest changes that lower the peak."""
    out = tmp_path / "run"
    proc = run_cli(*_args(out, tmp_path / "cache", MICRO, "train.max_steps=3", "checkpoint.at_end=false"),
                   env={OOM_ENV: "2"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(error) == 1, proc.stderr
    assert error[0].startswith("error: out of GPU memory in step 2 on rank 0: CUDA out of memory.")
    assert "shardtune plan CONFIG --all" in error[0]
    assert "train.micro_batch_size=2 train.grad_accum=2 (the same global batch)" in error[0]
    assert "parallel.activation_checkpointing=full" in error[0]


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


def _one_error_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_a_checkpoint_that_would_not_fit_is_refused_before_writing_and_the_previous_one_stays(tmp_path, cache):
    """2 processes, checkpoints on a 50 MB tmpfs; one checkpoint of this run takes 37.5 MB. Step 1's fits; before
    step 2's, the free space (12.5 MB) is below the size of step 1's: one line naming the folder and both sizes, exit
    code 2, nothing of step 2 on the disk, step 1 whole and the one --resume auto takes."""
    with small_tmpfs(tmp_path / "disk", "50m") as disk:
        proc = run_cli(*_args(tmp_path / "run", cache, "--nproc", "2", "train.max_steps=3",
                              "checkpoint.every_steps=1", "checkpoint.keep_last=5", f"checkpoint.dir={disk}"))
        line = _one_error_line(proc)
        assert line.startswith(f"error: checkpoint of step 2 not written: {disk} has ")
        assert "MB free and a checkpoint of this run takes about 37." in line and "(the size of step-00000001)" in line
        assert f"{disk / 'step-00000001'} is intact: --resume auto continues from it" in line
        assert sorted(p.name for p in disk.iterdir()) == ["step-00000001"]  # no partial step 2, no temporary folder
        assert resolve_checkpoint("auto", disk, check=True) == disk / "step-00000001"  # every byte as its manifest says


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_that_fills_during_a_save_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, cache, mode):
    """Checkpoints on a 20 MB tmpfs: the first checkpoint (37.5 MB; none before it to estimate from) fills the disk
    while DCP's four threads write it (async: in the background, found when the next save or the end waits for it).
    One line naming the folder, exit code 2, and the partial checkpoint removed: nothing listed or resumable, the
    disk empty again. (One process: the test above has two ranks agree.)"""
    with small_tmpfs(tmp_path / "disk", "20m") as disk:
        proc = run_cli(*_args(tmp_path / "run", cache, "train.max_steps=2", f"checkpoint.async={mode == 'async'}",
                              "checkpoint.every_steps=1", f"checkpoint.dir={disk}"))
        line = _one_error_line(proc)
        assert line.startswith(f"error: checkpoint of step 1 not written: no space left on the disk of {disk} (it "
                               "needs more than the ")
        assert "written before the disk filled" in line and "no complete checkpoint yet" in line
        assert list(disk.iterdir()) == [] and complete_checkpoints(disk) == []
        assert resolve_checkpoint("auto", disk) is None


def test_a_worker_killed_by_sigkill_is_one_line_about_host_memory_exit_137(tmp_path, cache):
    """Rank 1 dies of SIGKILL at step 2 (what the kernel's out-of-memory killer sends) while the launcher lives:
    rank 0, waiting for it in a collective, is ended by the launcher, which exits 137 (128 + SIGKILL, as a shell
    reports it) with one line: the rank, the out-of-memory killer, host memory, and this config's ways to lower it.
    No traceback, and no line from rank 0 about the lost peer."""
    proc = run_cli(*_args(tmp_path / "run", cache, MICRO, "--nproc", "2", "train.max_steps=3",
                          "checkpoint.async=true"), env={TEST_SIGKILL_ENV: "1:2"})
    assert proc.returncode == 137 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: worker process 1 was killed by SIGKILL, most likely by the kernel's "
                                "out-of-memory killer (host memory, not GPU memory;")
    assert "checkpoint.async=false" in errors[0] and "train.micro_batch_size=2 train.grad_accum=2" in errors[0]


def test_deepspeed_skips_and_counts_a_nan_step_as_fsdp2_does(tmp_path, cache):
    """The deepspeed backend at stage 0 (ddp: DeepSpeed hands the gradients to the torch optimizer as they are; its
    ZeRO stages skip by themselves, and the same step_skipped reports it): the NaN step 2 is skipped and counted, its
    loss kept out of the average, the LR schedule advances as under FSDP2, and the run goes on to a finite end."""
    out = tmp_path / "run"
    proc = _launch(*_args(out, cache, MICRO, "train.max_steps=3", "parallel.backend=deepspeed",
                          "parallel.strategy=ddp", "checkpoint.at_end=false"), nan_steps="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2: non-finite loss or gradient norm; update skipped" in proc.stderr
    records = _records(out)
    assert [records[s]["skipped_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert math.isnan(records[2]["loss"] if records[2]["loss"] is not None else math.nan)
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 3))
    assert records[1]["lr"] < records[2]["lr"] < records[3]["lr"]  # warm-up goes on through the skipped step
    assert (out / "model" / "model.safetensors").is_file()  # finite weights: written
