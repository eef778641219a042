"""Resumable sharded checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `step-NNNNNNNN/` holding:
  *.distcp + .metadata   model and optimizer state, WRITE_THREADS shard files per rank (DCP): loads on any
                         world size and across zero2 / zero3 / ddp, DCP reshards on load
  deepspeed/state/       instead, for the deepspeed backend: the engine's own files (resume on the
                         same number of processes; `shardtune export` reads any of them)
  trainer_state.json     step, sampler position, LR schedule, loss scaler, batch geometry, config
  rng/rank{R}.safetensors  each rank's RNG states
  hf/                    config.json + tokenizer, so `shardtune export` needs nothing else
  manifest.json          written last: every file with its size and CRC32

It is written under a temporary name and renamed into place by rank 0 only when every rank has
finished, so a crash or kill -9 at any moment leaves the previous checkpoint intact; a directory
without a valid manifest is never treated as a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from shardtune.config import CheckpointConfig
from shardtune.dist import DistContext
from shardtune.errors import ShardtuneError

VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
NATIVE_DIR = "deepspeed"  # a DeepSpeed-format checkpoint's engine files (format "deepspeed" in the manifest)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Each rank writes its shards as this many files, from as many threads (DCP's default is one file, one
# thread); the manifest's CRC32 pass then reads the files in parallel too (zlib releases the GIL).
WRITE_THREADS = 4


# ---- finding checkpoints ----------------------------------------------------------------------------

def checkpoint_root(cfg: CheckpointConfig, output_dir: str | Path) -> Path:
    """Where a run's checkpoints go: checkpoint.dir, else OUTPUT_DIR/checkpoints."""
    return Path(cfg.dir) if cfg.dir else Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == VERSION else None


def is_complete(path: Path) -> bool:
    """A manifest of this version, and every file it lists present with its recorded size."""
    manifest = read_manifest(path)
    if manifest is None:
        return False
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["size"]:
            return False
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if is_complete(p)]


def resolve_checkpoint(value: str, default_root: Path | None = None) -> Path | None:
    """`auto` -> the newest complete checkpoint under default_root (None if there is none); a path ->
    that checkpoint, or the newest one in a run directory or checkpoints folder. Raises for a
    path that holds no complete checkpoint."""
    if value == "auto":
        found = complete_checkpoints(default_root) if default_root else []
        return found[-1] if found else None
    path = Path(value)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if path.is_dir() and (path / MANIFEST).exists():
        raise ShardtuneError(f"checkpoint {value!r} is incomplete or damaged (files missing or of the wrong size); "
                             "resume from an earlier one or use --resume auto")
    raise ShardtuneError(f"checkpoint {value!r}: no complete checkpoint there; give a step-NNNNNNNN directory, "
                         "a run directory, or --resume auto")


# ---- safe reading: nothing in a checkpoint may run code ----------------------------------------------

_SAFE_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: allow only the classes DCP itself writes there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        if module in _SAFE_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never "
                                     "needs; refusing to load it")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise ShardtuneError(f"{self.path}: {err}") from None
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or _storage_meta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _storage_meta() -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries are read with torch.load(weights_only=True) (DCP's default unpickles them)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ShardtuneError(f"checkpoint entry {read_item.dest_index.fqn!r} is not plain data: {err}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_state(state: dict[str, Any], path: Path, *, partial: bool = False, no_dist: bool = False) -> None:
    """dcp.load through the safe reader and planner; a refusal surfaces as one ShardtuneError."""
    from torch.distributed.checkpoint.api import CheckpointException

    SafeReader(str(path)).read_metadata()  # refuses a tampered .metadata before DCP wraps the error
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(allow_partial_load=partial),
                 no_dist=no_dist)
    except CheckpointException as err:
        marker = "shardtune.errors.ShardtuneError: "
        for line in str(err).splitlines():
            if marker in line:
                raise ShardtuneError(line.split(marker, 1)[1].split(". In PyTorch")[0]) from None
        raise


# ---- writing ------------------------------------------------------------------------------------------

def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def _synced_file_info(path: Path) -> dict[str, int]:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: manifest last, then one atomic rename into place."""
    paths = sorted(p for p in tmp.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(2 * WRITE_THREADS, os.cpu_count() or 1)) as pool:
        files = dict(zip((str(f.relative_to(tmp)) for f in paths), pool.map(_synced_file_info, paths), strict=True))
    manifest = {"version": VERSION, **info, "files": files, "created": time.time()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if final.exists():  # the same step written again (e.g. a resumed run with nothing left to do)
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def verify(path: Path) -> None:
    """Check every file's size and CRC32 against the manifest (reads the whole checkpoint)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise ShardtuneError(f"{path}: no valid {MANIFEST}; not a complete checkpoint")
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["size"] or _crc32(f) != info["crc32"]:
            raise ShardtuneError(f"{path}: {rel} does not match the manifest (damaged checkpoint)")


def kept_stager(gpu: bool, shared: bool = False) -> Any:
    """A DCP DefaultStager (async staging on a side stream; pinned host buffers and non-blocking copies on
    GPUs; shared-memory buffers when `shared`, for a writer process) whose host buffers stay cached from one
    save to the next, or None on a torch without one.

    torch 2.11 clears a stager's buffer cache after every staging (pytorch #183413): a reused stager then
    fails the next save with `KeyError: <class 'type'>`, and a new stager per save pins the whole state
    again each time (measured on an H200: 15.9 GB, the step after the save took 9 s instead of 0.2 s).
    Here close() keeps the cache; release() frees it (and the staging thread) when the run ends."""
    try:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: staging blocks inside async_save
        return None

    class KeptStateDictStager(StateDictStager):
        def close(self) -> None:  # called by torch 2.11 after each staging
            pass

        def release(self) -> None:
            super().close()  # drops the cached host buffers (unpinned as they are collected)

    class KeptStager(DefaultStager):
        def close(self) -> None:  # async_save of some versions closes the caller's stager too
            pass

        def release(self) -> None:
            self._state_dict_stager.release()
            super().close()

    try:
        stager = KeptStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=shared,
                                           use_async_staging=True, use_non_blocking_copy=gpu))
        stager._state_dict_stager = KeptStateDictStager(pin_memory=gpu, share_memory=shared)
    except (TypeError, AttributeError):  # a torch whose staging classes differ: blocking staging
        return None
    return stager


class Checkpointer:
    """Decides when to save, writes checkpoints (sync or async), keeps the last K, loads one."""

    def __init__(self, cfg: CheckpointConfig, root: Path, ctx: DistContext, hf_dir_writer: Any, fmt: str) -> None:
        self.cfg, self.root, self.ctx = cfg, root, ctx
        self.fmt = fmt  # checkpoint_format(backend): "dcp" or "deepspeed"
        self.write_hf_dir = hf_dir_writer  # callable(path): writes config.json + tokenizer (rank 0)
        self.pending: Future | None = None
        self.staging: Future | None = None  # async: the copy to host memory still running
        self.stager: Any = None
        self.last_saved_step = -1
        self.last_time = time.monotonic()
        # Seconds the phases of a save took, set as they end (an async save's from its threads) and
        # handed to the next log record (rank 0's): checkpoint_staging_s (copy to host),
        # checkpoint_write_s (until rank 0 has put the checkpoint, every rank's files in it, in place).
        self.timings: dict[str, float] = {}
        self._timings_lock = threading.Lock()
        # Async saves run their collectives from a background thread on CPU tensors: a gloo group.
        self.async_group = dist.new_group(backend="gloo") if cfg.async_save and dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-ckpt")
        if ctx.is_main and root.is_dir():
            for stale in root.glob(".step-*.tmp"):  # left by a crash: never complete, safe to drop
                shutil.rmtree(stale, ignore_errors=True)
        self.writer_process = False
        if cfg.async_save and fmt == "dcp" and writes_from_process(cfg, ctx.device):
            root.mkdir(parents=True, exist_ok=True)
            self.writer_process = _start_writer_process(self.async_group, root / f"writer-rank{ctx.rank}.log")

    def due(self, step: int, last: bool) -> bool:
        """Whether to save after optimizer step `step` (1-based count of steps done)."""
        if step == self.last_saved_step:
            return False
        if last and self.cfg.at_end:
            return True
        if self.cfg.every_steps and step % self.cfg.every_steps == 0:
            return True
        if self.cfg.every_minutes:
            # Ranks must agree: rank 0's clock decides.
            flag = torch.tensor([float(time.monotonic() - self.last_time >= 60 * self.cfg.every_minutes)],
                                device=self.ctx.device)
            if dist.is_initialized():
                dist.broadcast(flag, src=0)
            return bool(flag.item())
        return False

    def save(self, step: int, backend: Any, trainer_state: dict[str, Any]) -> float:
        """Write a checkpoint of `step`; returns the seconds the training loop was blocked."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        started = time.perf_counter()
        tmp = self.root / f".step-{step:08d}.tmp"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            self.write_hf_dir(tmp / "hf")
        _barrier()
        _save_rng(tmp / "rng" / f"rank{self.ctx.rank}.safetensors", self.ctx.device)
        info = {"step": step, "world_size": self.ctx.world, "format": self.fmt}
        final = step_dir(self.root, step)
        if self.fmt == "dcp" and self.cfg.async_save:
            result = dcp.async_save(backend.state_dict(), storage_writer=ManifestWriter(tmp, final, info),
                                    process_group=self.async_group, **self._async_kwargs())
            written = getattr(result, "upload_completion", result)  # newer torch returns a response object
            self.staging = getattr(result, "staging_completion", None)
            if self.staging is not None:
                self.staging.add_done_callback(lambda _: self._timed("checkpoint_staging_s", started))
            # Rank 0's future completes once every rank has written and the checkpoint is in place.
            self.pending = (self._executor.submit(self._finish, written, started) if self.ctx.is_main
                            else written)
        else:
            if self.fmt == "deepspeed":
                # The engine writes its own sharded layout (one file per rank) and has no DCP async path.
                if self.cfg.async_save and self.last_saved_step < 0 and self.ctx.is_main:
                    print("warning: checkpoint.async is ignored by the deepspeed backend; checkpoints are "
                          "written synchronously", flush=True)
                backend.save_native(tmp / NATIVE_DIR)
                _barrier()
                if self.ctx.is_main:
                    finalize(tmp, final, info)
            else:
                dcp.save(backend.state_dict(), storage_writer=ManifestWriter(tmp, final, info))
            if self.ctx.is_main:
                self._finish(None, started)
            _barrier()
        self.last_saved_step = step
        self.last_time = time.monotonic()
        return time.perf_counter() - t0

    def _async_kwargs(self) -> dict[str, Any]:
        """Async staging into host buffers kept from one save to the next (pinned, on GPUs), on a side
        stream, as torchtitan does: the loop goes on with the next forward/backward while the shards are
        copied out, and only the first save pays for allocating (pinning) the buffers. With a writer
        process the buffers are in shared memory, so handing them over copies nothing."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.stager is None:
            self.stager = kept_stager(self.ctx.device.type == "cuda", shared=self.writer_process) or False
        kind = AsyncCheckpointerType.PROCESS if self.writer_process else AsyncCheckpointerType.THREAD
        return {"async_checkpointer_type": kind, **({"async_stager": self.stager} if self.stager else {})}

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
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then free the async staging buffers and stop the writer process."""
        self.wait()
        if self.stager:
            self.stager.release()
        self.stager = None
        self._executor.shutdown(wait=True)
        if self.writer_process:
            _stop_writer_process()

    def load(self, path: Path, backend: Any) -> dict[str, Any]:
        """Restore model, optimizer and RNG from `path`; returns its trainer state."""
        if self.fmt == "deepspeed":
            backend.load_native(path / NATIVE_DIR)
        else:
            state = backend.state_dict()
            load_state(state, path)
            backend.load_state_dict(state)
        trainer_state = read_trainer_state(path)
        if trainer_state.get("world_size") == self.ctx.world:
            _load_rng(path / "rng" / f"rank{self.ctx.rank}.safetensors", self.ctx.device)
        self.last_saved_step = int(trainer_state["step"])
        return trainer_state


def checkpoint_format(backend: Any) -> str:
    """"dcp" (FSDP2 / DDP tensors through torch.distributed.checkpoint) or "deepspeed" (the engine's own files)."""
    return getattr(backend, "checkpoint_format", "dcp")


def check_resumable(path: Path, backend: str, world: int) -> None:
    """Refuse, before anything is built, a resume that the checkpoint's format cannot do."""
    manifest = read_manifest(path) or {}
    fmt = manifest.get("format", "dcp")
    wants = "deepspeed" if backend == "deepspeed" else "dcp"
    if fmt != wants:
        writer = "deepspeed" if fmt == "deepspeed" else "fsdp2"
        raise ShardtuneError(f"checkpoint {path} was written by the {writer} backend and cannot be resumed with "
                             f"parallel.backend={backend}; resume with parallel.backend={writer}, or "
                             f"`shardtune export {path} DIR` and start a new run from DIR")
    saved_world = int(manifest.get("world_size", world))
    if fmt == "deepspeed" and saved_world != world:
        raise ShardtuneError(f"checkpoint {path} is a DeepSpeed checkpoint of {saved_world} processes; DeepSpeed "
                             f"resumes on the same number only: use --nproc {saved_world} (or the fsdp2 backend, "
                             "whose checkpoints reshard to any count)")


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as err:
        raise ShardtuneError(f"{path}: cannot read {TRAINER_STATE} ({err})") from None


def writes_from_process(cfg: CheckpointConfig, device: torch.device) -> bool:
    """Whether async saves write from a separate process. On GPUs the writer's Python threads would
    otherwise share the GIL with the thread that launches the training kernels; on CPU a process
    costs a second torch import per rank for nothing measured."""
    return cfg.async_writer == "process" or (cfg.async_writer == "auto" and device.type == "cuda")


def _start_writer_process(group: Any, log: Path) -> bool:
    """Start DCP's writer process now, before training (every rank at once: the writers form their own
    gloo group), with its output going to `log`: it logs each save at INFO on every rank, and would
    otherwise be started at the first save, from a thread, while training prints to the same stderr.
    Returns False (async saves then write from a thread) on a torch whose writer process differs."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor

        info, start = executor._ProcessGroupInitInfo(group), executor._AsyncCheckpointProcess
    except (ImportError, AttributeError, TypeError):
        return False
    if getattr(executor, "_CHECKPOINT_PROCESS", None) is None:
        with _stderr_to(log):
            executor._CHECKPOINT_PROCESS = start(pg_init_info=info)
    return True


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at `path` while a child process is started (it inherits it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _stop_writer_process() -> None:
    """Stop DCP's writer process now (it is a daemon and would otherwise live until this process exits)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        executor._CHECKPOINT_PROCESS = None
        proc.__del__()  # sends TERMINATE and joins (DCP's own shutdown path)


class ManifestWriter(FileSystemWriter):
    """DCP's file writer (WRITE_THREADS files per rank), whose finish, which DCP runs on rank 0 once every
    rank has written, also writes the manifest and renames the checkpoint into place. With a writer
    process, that is where the CRC32 pass over the files runs: outside the training process."""

    def __init__(self, tmp: Path, final: Path, info: dict[str, Any]) -> None:
        super().__init__(str(tmp), thread_count=WRITE_THREADS)
        self.tmp, self.final, self.info = tmp, final, info

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        finalize(self.tmp, self.final, self.info)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _save_rng(path: Path, device: torch.device) -> None:
    from safetensors.torch import save_file

    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    save_file(states, str(path))


def _load_rng(path: Path, device: torch.device) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        return
    states = load_file(str(path))
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
