"""The Checkpointer: when to save, the checkpoint's directory around the format's files (layout.py: trainer
state, hf/, RNG, manifest, atomic rename), retention of the last K, and resume. What holds the model and
optimizer state is the format's business (formats.py); nothing here asks which format a run has."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardtune.checkpoint.formats import Format
from shardtune.checkpoint.layout import (
    TRAINER_STATE,
    complete_checkpoints,
    read_manifest,
    read_trainer_state,
    record_own,
    step_dir,
)
from shardtune.config import CheckpointConfig
from shardtune.dist import DistContext, first_problem
from shardtune.errors import ShardtuneError
from shardtune.fileio import disk_full, free_bytes, size_text, tree_bytes


class Checkpointer:
    """Decides when to save, writes checkpoints (sync or async), keeps the last K, loads one."""

    def __init__(self, cfg: CheckpointConfig, root: Path, ctx: DistContext, hf_dir_writer: Callable[[Path], None],
                 fmt: Format) -> None:
        self.cfg, self.root, self.ctx = cfg, root, ctx
        self.fmt = fmt  # the backend's format (formats.make_format)
        self.write_hf_dir = hf_dir_writer  # callable(path): writes config.json + tokenizer (rank 0)
        self.pending: Future | None = None
        self._inflight: tuple[int, Path] = (0, root)  # the step and temporary folder of the save last started
        self.staging: Future | None = None  # async: the copy to host memory still running
        self.last_saved_step = -1
        self.last_time = time.monotonic()
        # Seconds the phases of a save took, set as they end (an async save's from its threads) and
        # handed to the next log record (rank 0's): checkpoint_staging_s (copy to host),
        # checkpoint_write_s (until rank 0 has put the checkpoint, every rank's files in it, in place).
        self.timings: dict[str, float] = {}
        self._timings_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-ckpt")
        if ctx.is_main and root.is_dir():
            for stale in root.glob(".step-*.tmp"):  # left by a crash: never complete, safe to drop
                shutil.rmtree(stale, ignore_errors=True)
        fmt.start(cfg, ctx, root)

    def due(self, step: int, last: bool) -> bool:
        """Whether to save after optimizer step `step` (1-based count of steps done)."""
        if step == self.last_saved_step:
            return False
        if last and self.cfg.at_end:
            return True
        if self.cfg.every_steps and step % self.cfg.every_steps == 0:
            return True
        if self.cfg.every_minutes:
            elapsed = time.monotonic() - self.last_time >= 60 * self.cfg.every_minutes
            if self.ctx.world == 1:
                return elapsed  # no one to agree with, and no wait for the GPU's queue each step
            # Ranks must agree: rank 0's clock decides.
            flag = torch.tensor([float(elapsed)], device=self.ctx.device)
            if dist.is_initialized():
                dist.broadcast(flag, src=0)
            return bool(flag.item())
        return False

    def save(self, step: int, backend: Any, trainer_state: dict[str, Any]) -> float:
        """Write a checkpoint of `step`; returns the seconds the training loop was blocked.

        A full disk stops the run with one line (ShardtuneError, on every rank): before anything is written when
        the free space is below the size of the newest checkpoint, else when a write fails for lack of space. The
        partial checkpoint is removed; the earlier ones stay as they were."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        started = time.perf_counter()
        tmp = self.root / f".step-{step:08d}.tmp"
        problem = None
        if self.ctx.is_main:
            problem = self._space_problem(step)
            if problem is None:
                try:
                    shutil.rmtree(tmp, ignore_errors=True)
                    (tmp / "rng").mkdir(parents=True)
                    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
                    self.write_hf_dir(tmp / "hf")
                except Exception as err:
                    if not disk_full(err):
                        raise
                    problem = self._no_space(step, tmp)
        self._raise_if(first_problem(problem), step, tmp)  # also the barrier before the ranks write into tmp
        rng = tmp / "rng" / f"rank{self.ctx.rank}.safetensors"
        problem = None
        try:
            _save_rng(rng, self.ctx.device)
            record_own(tmp, [rng], self.ctx.rank, "rng")
        except Exception as err:
            if not disk_full(err):
                raise
            problem = self._no_space(step, tmp, clean=False)  # other ranks may be writing into tmp still
        self._raise_if(first_problem(problem), step, tmp)
        info = {"step": step, "world_size": self.ctx.world, "format": self.fmt.name}
        self._inflight = (step, tmp)
        try:
            written = self.fmt.write(backend, tmp, step_dir(self.root, step), info)
        except BaseException as err:  # every rank's write has ended (the format's write is collective)
            # (DCP's CheckpointException is a BaseException.)
            if not disk_full(err):
                raise
            raise ShardtuneError(self._no_space(step, tmp)) from None
        if written.done is None:  # written and in place already
            if self.ctx.is_main:
                self._finish(None, started)
            _barrier()
        else:
            self.staging = written.staging
            if self.staging is not None:
                self.staging.add_done_callback(lambda _: self._timed("checkpoint_staging_s", started))
            # Rank 0's future completes once every rank has written and the checkpoint is in place.
            self.pending = self._executor.submit(self._finish, written.done, started) if self.ctx.is_main \
                else written.done
        self.last_saved_step = step
        self.last_time = time.monotonic()
        return time.perf_counter() - t0

    def _newest(self) -> tuple[Path, int] | None:
        """The newest complete checkpoint and its size in bytes (its manifest's files), or None."""
        found = complete_checkpoints(self.root)
        manifest = read_manifest(found[-1]) if found else None
        if manifest is None:
            return None
        return found[-1], sum(int(f["size"]) for f in manifest["files"].values())

    def _space_problem(self, step: int) -> str | None:
        """Rank 0, before a save: the refusal when the free space is below the size of the newest checkpoint (the
        next one is about as large: the same tensors). None when it fits, or with no checkpoint to go by."""
        newest = self._newest()
        free = free_bytes(self.root)
        if newest is None or free is None or free >= newest[1]:
            return None
        return (f"checkpoint of step {step} not written: {self.root} has {size_text(free)} free and a checkpoint "
                f"of this run takes about {size_text(newest[1])} (the size of {newest[0].name}); {self._fix(newest)}")

    def _no_space(self, step: int, tmp: Path, clean: bool = True) -> str:
        """The line for a write that failed on a full disk; rank 0 removes the partial checkpoint when `clean` (no
        rank writes into it any more)."""
        written = tree_bytes(tmp) if self.ctx.is_main else 0
        if self.ctx.is_main and clean:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = self._newest()
        size = (f"a checkpoint of this run takes about {size_text(newest[1])} (the size of {newest[0].name})"
                if newest else f"it needs more than the {size_text(written)} written before the disk filled"
                if written else "its size is not known yet")
        return (f"checkpoint of step {step} not written: no space left on the disk of {self.root} ({size}; "
                f"{size_text(free_bytes(self.root))} free without the partial checkpoint, which was removed); "
                f"{self._fix(newest)}")

    def _fix(self, newest: tuple[Path, int] | None) -> str:
        if newest is None:
            return "free space there, or set checkpoint.dir to a larger disk; no complete checkpoint yet"
        return (f"free space there, lower checkpoint.keep_last (now {self.cfg.keep_last}) or set checkpoint.dir to "
                f"a larger disk; {newest[0]} is intact: --resume auto continues from it")

    def _raise_if(self, problem: str | None, step: int, tmp: Path) -> None:
        if problem is None:
            return
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ShardtuneError(problem)

    def before_update(self) -> float:
        """Call before the optimizer changes parameters: waits for an async save's staging copy.
        Returns the seconds waited."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        staging, self.staging = self.staging, None
        staging.result()
        return time.perf_counter() - t0

    def _finish(self, written: Future | None, started: float) -> None:
        if written is not None:
            written.result()  # re-raises a failed write
        self._timed("checkpoint_write_s", started)
        for old in complete_checkpoints(self.root)[:-self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _timed(self, phase: str, started: float) -> None:
        with self._timings_lock:
            self.timings[phase] = time.perf_counter() - started

    def pop_timings(self) -> dict[str, float]:
        """The phase durations of saves that ended since the last call."""
        with self._timings_lock:
            done, self.timings = self.timings, {}
        return done

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and, on rank 0, in place."""
        self.before_update()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except BaseException as err:  # an async save's write failed; on rank 0 it was not put in place
                if not disk_full(err):
                    raise
                raise ShardtuneError(self._no_space(*self._inflight)) from None

    def close(self) -> None:
        """Wait for the save in flight, then free what the format kept (async buffers, a writer process)."""
        self.wait()
        self.fmt.close()
        self._executor.shutdown(wait=True)

    def load(self, path: Path, backend: Any) -> dict[str, Any]:
        """Restore model, optimizer and RNG from `path`; returns its trainer state."""
        self.fmt.read(backend, path)
        trainer_state = read_trainer_state(path)
        if trainer_state.get("world_size") == self.ctx.world:
            _load_rng(path / "rng" / f"rank{self.ctx.rank}.safetensors", self.ctx.device)
        self.last_saved_step = int(trainer_state["step"])
        return trainer_state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _save_rng(path: Path, device: torch.device) -> None:
    from shardtune.fileio import save_safetensors

    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    save_safetensors(states, path)


def _load_rng(path: Path, device: torch.device) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        return
    states = load_file(str(path))
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def check_shared_root(root: Path, ctx: DistContext, local_world: int) -> None:
    """Refuse, before training, a checkpoint folder that is not one folder for every node: rank 0 writes a marker
    there and each node's local rank 0 looks for it. Checkpoint shards are written by every rank into `root`; a
    node that writes them into a folder of its own (a node-local disk, a path that differs per node) leaves
    checkpoints that no node can resume, which would otherwise show only at the first resume.

    With one node (`local_world` = the world) there is nothing to check. Costs one broadcast and one gather."""
    import uuid

    import torch.distributed as dist

    if not dist.is_initialized() or ctx.world <= local_world:
        return
    token = [uuid.uuid4().hex if ctx.is_main else "", str(root.absolute()) if ctx.is_main else ""]
    marker_problem = ""
    if ctx.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / f".shared-{token[0]}").write_text(token[0])
        except OSError as err:
            marker_problem = err.strerror or str(err)
    dist.broadcast_object_list(token, src=0)
    seen = True
    if ctx.rank % local_world == 0 and not ctx.is_main:  # a node's first rank (torchrun numbers nodes in blocks)
        try:
            seen = (root / f".shared-{token[0]}").read_text() == token[0]
        except OSError:
            seen = False
    everyone: list[bool] = [True] * ctx.world
    dist.all_gather_object(everyone, seen)
    if ctx.is_main:
        (root / f".shared-{token[0]}").unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(everyone) if not ok]
    if marker_problem:
        raise ShardtuneError(f"checkpoint folder {root}: cannot write there ({marker_problem})")
    if blind:
        here = "" if str(root.absolute()) == token[1] else f" (this node's is {root.absolute()})"
        raise ShardtuneError(f"checkpoint folder {token[1]}{here} is not shared by every node: rank {blind[0]}'s node "
                             f"does not see the file rank 0 wrote there ({len(blind)} node(s) in all); put "
                             "train.output_dir (or checkpoint.dir) on storage every node mounts at the same path")
