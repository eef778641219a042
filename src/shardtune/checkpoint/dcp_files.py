"""The DCP checkpoint format: model and optimizer state through torch.distributed.checkpoint, WRITE_THREADS
shard files per rank. It loads on any world size and across zero2 / zero3 / ddp (DCP reshards on load),
and writes in the background (`checkpoint.async`): the copy to host memory runs while the next
forward/backward does, the write from threads or, on GPUs, from a writer process per rank.

Nothing in a checkpoint may run code: DCP's .metadata pickle is read through an allow-list unpickler,
its non-tensor entries with torch.load(weights_only=True).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pickle
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from shardtune.checkpoint.formats import LazyTensor, Written
from shardtune.checkpoint.layout import finalize, record_own
from shardtune.config import CheckpointConfig
from shardtune.dist import DistContext
from shardtune.errors import ShardtuneError
from shardtune.fileio import disk_full

# Each rank writes its shards as this many files, from as many threads (DCP's default is one file, one thread).
WRITE_THREADS = 4
MODEL_PREFIX = "model."  # the checkpoint's state is {"model": ..., "optim": ...}, flattened by DCP


class DCPFormat:
    """Backends whose state_dict() DCP can save (FSDP2 / DDP): reshardable, asynchronous."""

    name = "dcp"
    reshardable = True
    asynchronous = True

    def __init__(self) -> None:
        self.cfg: CheckpointConfig | None = None
        self.async_group: Any = None
        self.stager: Any = None
        self.writer_process = False

    def start(self, cfg: CheckpointConfig, ctx: DistContext, root: Path) -> None:
        """Before the first save, on every rank: async saves run their collectives from a background thread
        on CPU tensors (a gloo group), and on GPUs from DCP's writer process, started now."""
        self.cfg, self.ctx = cfg, ctx
        self.async_group = dist.new_group(backend="gloo") if cfg.async_save and dist.is_initialized() else None
        if cfg.async_save and writes_from_process(cfg, ctx.device):
            root.mkdir(parents=True, exist_ok=True)
            self.writer_process = _start_writer_process(self.async_group, root / f"writer-rank{ctx.rank}.log")

    def write(self, backend: Any, tmp: Path, final: Path, info: dict[str, Any]) -> Written:
        """Collective: the backend's state_dict() into `tmp`; DCP's finish (rank 0, once every rank has written)
        writes the manifest and renames `tmp` to `final`."""
        writer = ManifestWriter(tmp, final, info)
        if not (self.cfg and self.cfg.async_save):
            dcp.save(backend.state_dict(), storage_writer=writer)
            return Written()
        result = dcp.async_save(backend.state_dict(), storage_writer=writer, process_group=self.async_group,
                                **self._async_kwargs())
        # Newer torch returns a response object with both futures; older ones the write's future alone.
        return Written(staging=getattr(result, "staging_completion", None),
                       done=getattr(result, "upload_completion", result))

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

    def read(self, backend: Any, path: Path) -> None:
        state = backend.state_dict()
        load_state(state, path)
        backend.load_state_dict(state)

    def resume_on(self, path: Path, saved_world: int, world: int) -> None:
        """DCP reshards on load: any number of processes."""

    def tensors(self, path: Path) -> dict[str, LazyTensor]:
        return {name: LazyTensor(tuple(meta.size), meta.properties.dtype,
                                 functools.partial(read_tensor, path, MODEL_PREFIX + name, meta))
                for name, meta in model_tensors(path).items()}

    def close(self) -> None:
        """Free the async staging buffers and stop the writer process (the run's last save has finished)."""
        if self.stager:
            self.stager.release()
        self.stager = None
        if self.writer_process:
            _stop_writer_process()
            self.writer_process = False


def model_tensors(path: Path) -> dict[str, Any]:
    """Parameter name -> DCP tensor metadata (shape, dtype) of the model in a checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(str(path)).read_metadata()
    return {key[len(MODEL_PREFIX):]: meta for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}


def read_tensor(path: Path, key: str, meta: Any) -> torch.Tensor:
    """One full tensor (`key` as DCP names it, e.g. model.lm_head.weight), assembled from however
    many rank shards hold it."""
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        load_state({key: tensor}, path, partial=True, no_dist=True)
    return tensor



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
        _catch_writer_threads()

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write this rank's files, then checksum them here: rank 0's finish reads no other rank's files.

        A failure in any of DCP's writer threads fails the save (DCP itself only prints it, and would go on with
        that thread's files missing or cut short), and a full disk is raised as ENOSPC: torch's zip writer turns it
        into "unexpected pos", and DCP passes every rank's failure on as text."""
        _take_thread_errors()  # a failed earlier save's threads
        try:
            written = super().write_data(plan, planner)
            results = written.wait()
        except Exception as err:
            _take_thread_errors()
            if not disk_full(err):
                raise
            raise _enospc(err) from err
        if failed := _take_thread_errors():
            if not disk_full(failed[0]):
                raise failed[0]
            raise _enospc(failed[0]) from failed[0]
        rank = self.rank if self.rank is not None else int(plan.storage_data.prefix.strip("_"))  # "__R_"
        names = sorted({r.storage_data.relative_path for r in results})
        record_own(self.tmp, [self.tmp / name for name in names], rank, "dcp")
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        finalize(self.tmp, self.final, self.info)


_WRITER_THREAD = "(_write_files_from_queue)"  # how Python names DCP's writer threads: "Thread-N (target)"
_thread_errors: list[BaseException] = []
_thread_errors_lock = threading.Lock()


def _catch_writer_threads() -> None:
    """Keep DCP writer threads' exceptions for write_data (instead of a traceback on stderr); others as before."""
    previous = threading.excepthook
    if getattr(previous, "shardtune", False):
        return

    def hook(args: Any) -> None:
        if args.thread is not None and args.thread.name.endswith(_WRITER_THREAD) and args.exc_value is not None:
            with _thread_errors_lock:
                _thread_errors.append(args.exc_value)
        else:
            previous(args)

    hook.shardtune = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _take_thread_errors() -> list[BaseException]:
    with _thread_errors_lock:
        taken = list(_thread_errors)
        _thread_errors.clear()
    return taken


def _enospc(err: BaseException) -> OSError:
    """A full disk as a plain OSError(ENOSPC), whose text says so wherever DCP passes it on."""
    return OSError(errno.ENOSPC, f"No space left on device ({type(err).__name__}: {str(err)[:200]})")
