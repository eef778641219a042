"""Tokenized data sets on disk: a memory-mapped TokenStore, a streaming parallel builder and a shared cache.

On-disk format (``FORMAT_VERSION`` 1), one directory per tokenized source::

    input_ids.npy   uint32  [T]    every example's token ids, concatenated in row order
    trainable.npy   bool    [T]    1 where the token carries loss (same positions as input_ids)
    offsets.npy     int64   [N+1]  example i is [offsets[i], offsets[i+1]); offsets[0] = 0, offsets[N] = T
    meta.json                      counts, bad rows, length percentiles, version (see build_store)

All three arrays are ordinary ``.npy`` (format 1.0) files that ``np.load`` reads. While building, each is
written as a 128-byte placeholder followed by raw little-endian data appended chunk by chunk; the real
header (``np.lib.format.write_array_header_1_0``, always 128 bytes for a 1-D array because numpy pads
the shape for growth) is written over the placeholder at the end. Nothing is ever copied, and peak RAM
is a few chunks of rows, whatever the size of the data set.

A store is built in a temporary directory next to its final path and renamed into place with
``os.replace`` once every file is complete and flushed, so a directory at the final path with a
``meta.json`` of the current version is always a complete store.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import pickle
import shutil
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from shardtune.data.types import BadRow, RowItem
from shardtune.errors import ShardtuneError
from shardtune.fileio import fsync_dir

FORMAT_VERSION = 1
HEADER_BYTES = 128  # .npy v1.0 header of any 1-D array (numpy pads the shape to 21 digits)
FILES = {"input_ids": np.dtype("<u4"), "trainable": np.dtype("|b1"), "offsets": np.dtype("<i8")}
MAX_FIRST = 5  # locations kept per bad-row reason
MAX_REASONS = 50  # distinct reasons kept; further ones are counted under OTHER_REASONS
OTHER_REASONS = "(other reasons)"
# Workers never fork the (multi-threaded: torch, gloo/NCCL, tokenizers) training process: "forkserver"
# forks them from a clean single-threaded server that has preloaded this module and the encoder's, so
# after the first pool of a process (~3 s to start the server) a pool starts as fast as with fork;
# "spawn" (used where forkserver is missing) pays that start-up in every pool. See _mp_context.
MP_CONTEXT = "forkserver"
SERIAL_WARMUP_S = 2.0  # encode in this process for this long before starting num_proc workers

# (where, row, error) as sent to the encoder workers: plain tuples pickle smaller than RowItems.
_Row = tuple[str, "dict[str, Any] | None", "str | None"]


class TokenStore:
    """A read-only tokenized data set, memory-mapped: opening one reads only meta.json and the headers.

    ``store.example(i)`` (or ``store[i]``) returns ``(input_ids uint32, trainable bool)`` as read-only
    numpy views of the mapped files (copy them before changing them; ``np.asarray(ids, np.int64)``
    for torch). ``lengths`` is the only array built in RAM (8 bytes per example, on first use).
    A TokenStore pickles as its path (DataLoader workers reopen the files rather than copy them).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise ShardtuneError(f"{self.directory} is not a tokenized data set (no meta.json)") from None
        if self.meta.get("version") != FORMAT_VERSION:
            raise ShardtuneError(f"{self.directory}: tokenized data set version {self.meta.get('version')!r}, "
                                 f"this shardtune reads version {FORMAT_VERSION}; delete it to rebuild")
        self.input_ids: np.ndarray = np.load(self.directory / "input_ids.npy", mmap_mode="r")
        self.trainable: np.ndarray = np.load(self.directory / "trainable.npy", mmap_mode="r")
        self.offsets: np.ndarray = np.load(self.directory / "offsets.npy", mmap_mode="r")
        n_tok = int(self.offsets[-1])
        if len(self.input_ids) != n_tok or len(self.trainable) != n_tok:
            raise ShardtuneError(f"{self.directory}: files disagree ({len(self.input_ids)} ids, "
                                 f"{len(self.trainable)} flags, offsets end at {n_tok}); delete it to rebuild")
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each example (int64 [N])."""
        if self._lengths is None:
            self._lengths = np.diff(np.asarray(self.offsets)).astype(np.int64, copy=False)
        return self._lengths

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, trainable) of example i: read-only views into the mapped files."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"example {i} out of range for a data set of {n}")
        i %= n
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.trainable[a:b]

    __getitem__ = example

    def trainable_counts(self, limit: np.ndarray | int | None = None, *, skip_first: bool = True,
                         block_tokens: int = 1 << 24) -> np.ndarray:
        """Loss-carrying tokens of every example (int64 [N]), vectorised and in bounded memory.

        Counts within each example's first ``limit`` tokens (an int, or one per example; None = all),
        leaving out position 0 when ``skip_first`` (nothing precedes it, so it is never a target).
        Reads the flags in blocks of about ``block_tokens`` (~5 bytes of RAM per token of a block).
        """
        n = len(self)
        offsets = self.offsets
        lengths = self.lengths
        stop = lengths if limit is None else np.minimum(lengths, np.broadcast_to(np.asarray(limit, np.int64), (n,)))
        start = np.minimum(stop, 1) if skip_first else np.zeros(n, np.int64)
        out = np.zeros(n, dtype=np.int64)
        i = 0
        while i < n:
            # examples i..j-1 in one block (at least one example, however long)
            j = max(i + 1, int(np.searchsorted(offsets, offsets[i] + block_tokens, side="right")) - 1)
            j = min(j, n)
            base = int(offsets[i])
            flags = np.asarray(self.trainable[base:int(offsets[j])])
            cum = np.zeros(len(flags) + 1, dtype=np.int64 if len(flags) >= 2**31 else np.int32)
            np.cumsum(flags, dtype=cum.dtype, out=cum[1:])
            rel = np.asarray(offsets[i:j], dtype=np.int64) - base
            out[i:j] = cum[rel + stop[i:j]] - cum[rel + start[i:j]]
            i = j
        return out

    def __repr__(self) -> str:
        return f"TokenStore({str(self.directory)!r}, examples={len(self)}, tokens={self.num_tokens})"

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])  # type: ignore[misc]


# ---- building ---------------------------------------------------------------------------------------

_WORKER_ENCODER: Any = None


def _init_worker(encoder_blob: bytes) -> None:
    # Before the encoder is unpickled (which imports tokenizers/torch): one thread per worker process.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    global _WORKER_ENCODER
    _WORKER_ENCODER = pickle.loads(encoder_blob)


def _encode_in_worker(chunk: list[_Row], strict: bool) -> _Encoded:
    return _encode_chunk(_WORKER_ENCODER, chunk, strict)


_Encoded = tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, str]]]


def _encode_chunk(encoder: Callable[[dict[str, Any]], tuple[list[int], list[bool]]], chunk: list[_Row],
                  strict: bool) -> _Encoded:
    """(ids uint32, trainable bool, lengths int64, bad rows [(where, reason)]) of a chunk, in row order."""
    ids: list[int] = []
    flags: list[bool] = []
    lengths: list[int] = []
    bad: list[tuple[str, str]] = []
    for where, row, error in chunk:
        if error is None:
            try:
                x, t = encoder(row)
            except BadRow as err:
                error = str(err) or "bad row"
            except Exception as err:
                raise RuntimeError(f"{where}: the encoder failed ({type(err).__name__}: {err})") from err
            else:
                if len(x) != len(t):
                    raise RuntimeError(f"{where}: the encoder returned {len(x)} ids and {len(t)} trainable flags")
                if len(x) == 0:
                    error = "no tokens"
                else:
                    ids.extend(x)
                    flags.extend(t)
                    lengths.append(len(x))
        if error is not None:
            bad.append((where, error))
            if strict:
                break
    try:
        ids_arr = np.array(ids, dtype=np.uint32)
    except OverflowError as err:
        raise RuntimeError(f"{chunk[0][0]}..: the encoder returned a token id outside 0..2**32-1") from err
    return ids_arr, np.array(flags, dtype=np.bool_), np.array(lengths, dtype=np.int64), bad


def _mp_context(encoder: Any) -> multiprocessing.context.BaseContext:
    method = MP_CONTEXT
    if method == "forkserver" and method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when this process first starts its fork server (later calls change nothing).
        # "__main__" is the default preload: encoders defined in the main script unpickle in the workers.
        preload = ["__main__", __name__]
        module = type(encoder).__module__
        if module not in ("__main__", "builtins"):
            preload.append(module)
        ctx.set_forkserver_preload(preload)  # type: ignore[attr-defined]
    return ctx


def _chunks(rows: Iterable[RowItem], size: int) -> Iterator[list[_Row]]:
    chunk: list[_Row] = []
    for item in rows:
        chunk.append((item.where, item.row, item.error))
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded_chunks(chunks: Iterator[list[_Row]], encoder: Any, num_proc: int, strict: bool,
                    used: list[int]) -> Iterator[_Encoded]:
    """Encoded chunks in input order.

    The first SERIAL_WARMUP_S seconds of chunks are encoded in this process: a data set that takes less
    never pays for starting workers (~1-3 s). After that, with num_proc > 1, the rest goes to a pool with
    at most 2 * num_proc chunks in flight, so the input is read only as fast as the workers encode it.
    ``used[0]`` is set to the number of processes that encoded.
    """
    used[0] = 1
    switch_at = time.monotonic() + SERIAL_WARMUP_S
    for chunk in chunks:
        yield _encode_chunk(encoder, chunk, strict)
        if num_proc > 1 and time.monotonic() >= switch_at:
            break
    else:
        return
    following = next(chunks, None)
    if following is None:
        return
    used[0] = num_proc
    pool = ProcessPoolExecutor(num_proc, mp_context=_mp_context(encoder),
                               initializer=_init_worker, initargs=(pickle.dumps(encoder),))
    try:
        pending: deque[Future[_Encoded]] = deque()
        for chunk in itertools.chain([following], chunks):
            pending.append(pool.submit(_encode_in_worker, chunk, strict))
            while len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _ArrayWriter:
    """A 1-D .npy file written as placeholder header + appended raw data, header fixed at the end."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.length = path, dtype, 0
        self.file = open(path, "wb")  # noqa: SIM115 - closed in finish()/close()
        self.file.write(b"\0" * HEADER_BYTES)

    def append(self, arr: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.length += len(arr)

    def finish(self) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                     "shape": (self.length,)})
        if len(header.getvalue()) != HEADER_BYTES:  # cannot happen for 1-D arrays; never write a bad file
            raise RuntimeError(f"unexpected .npy header size {len(header.getvalue())}")
        self.file.seek(0)
        self.file.write(header.getvalue())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def close(self) -> None:
        self.file.close()


class _BadRows:
    def __init__(self) -> None:
        self.by_reason: dict[str, dict[str, Any]] = {}
        self.total = 0

    def add(self, where: str, reason: str) -> None:
        self.total += 1
        if reason not in self.by_reason and len(self.by_reason) >= MAX_REASONS:
            reason = OTHER_REASONS
        entry = self.by_reason.setdefault(reason, {"count": 0, "first": []})
        entry["count"] += 1
        if len(entry["first"]) < MAX_FIRST:
            entry["first"].append(where)


def _percentiles(lengths: np.ndarray) -> dict[str, int]:
    if len(lengths) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"p50": int(p50), "p90": int(p90), "p99": int(p99), "max": int(lengths.max())}


def build_store(rows: Iterable[RowItem], encoder: Callable[[dict[str, Any]], tuple[list[int], list[bool]]],
                directory: str | Path, *, num_proc: int, strict: bool, chunk_size: int = 1024,
                extra_meta: dict[str, Any] | None = None,
                progress: Callable[[int, int], None] | None = None) -> TokenStore:
    """Tokenize ``rows`` with ``encoder`` into a TokenStore at ``directory``, streaming.

    Rows are read lazily in chunks of ``chunk_size``; with ``num_proc > 1`` the chunks are encoded by that
    many worker processes (``MP_CONTEXT``; the encoder must pickle, and is sent once per worker) and
    written in row order as they come back, so RAM holds about ``2 * num_proc + 1`` chunks at most.
    Workers start only once encoding has taken ``SERIAL_WARMUP_S`` (small data sets stay in-process).

    Bad rows -- ``RowItem.error`` set, the encoder raising ``BadRow``, or no tokens -- are skipped and
    counted by reason with their first locations; with ``strict`` the first one raises
    ``ShardtuneError("{where}: {reason}")``. Any other exception from the encoder is a bug: it propagates
    (as RuntimeError naming the row). Either way no directory appears at ``directory``.

    ``extra_meta`` is stored under ``meta["extra"]``; ``progress(rows_read, examples_written)`` is called
    after every chunk written. An existing store at ``directory`` is replaced.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    writers: dict[str, _ArrayWriter] = {}
    started = time.time()
    try:
        writers = {name: _ArrayWriter(tmp / f"{name}.npy", dtype) for name, dtype in FILES.items()}
        writers["offsets"].append(np.zeros(1, np.int64))
        rows_read = 0
        total = 0
        trainable_total = 0
        bad = _BadRows()

        def counted() -> Iterator[RowItem]:
            nonlocal rows_read
            for item in rows:
                rows_read += 1
                yield item

        used = [1]
        encoded = contextlib.closing(_encoded_chunks(_chunks(counted(), chunk_size), encoder, num_proc, strict,
                                                     used))
        with encoded as chunks:  # closing stops the workers at once if a bad row (strict) or an error ends this
            for ids, flags, lengths, bad_rows in chunks:
                if strict and bad_rows:
                    where, reason = bad_rows[0]
                    raise ShardtuneError(f"{where}: {reason}")
                for where, reason in bad_rows:
                    bad.add(where, reason)
                writers["input_ids"].append(ids)
                writers["trainable"].append(flags)
                writers["offsets"].append(total + np.cumsum(lengths))
                total += len(ids)
                trainable_total += int(np.count_nonzero(flags))
                if progress is not None:
                    progress(rows_read, writers["offsets"].length - 1)
        for w in writers.values():
            w.finish()
        offsets = np.load(tmp / "offsets.npy", mmap_mode="r")
        num_examples = len(offsets) - 1
        meta = {
            "version": FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.time() - started, 3),
            "num_proc": used[0],  # processes that encoded (1 if the data took < SERIAL_WARMUP_S)
            "num_rows_read": rows_read,
            "num_examples": num_examples,
            "num_bad_rows": bad.total,
            "bad_rows": bad.by_reason,
            "num_tokens": total,
            "num_trainable_tokens": trainable_total,
            "length_percentiles": _percentiles(np.diff(offsets)),
            "dtypes": {name: np.lib.format.dtype_to_descr(dt) for name, dt in FILES.items()},
            "extra": extra_meta or {},
        }
        del offsets
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp, required=False)
        _move_into_place(tmp, directory)
    except BaseException:
        for w in writers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory.parent, required=False)
    return TokenStore(directory)


def _move_into_place(tmp: Path, directory: Path) -> None:
    try:
        os.replace(tmp, directory)
    except OSError:
        if not directory.exists():
            raise
        # An old (other version, or rebuilt on purpose) store is there: move it aside, then swap.
        aside = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, aside)
        os.replace(tmp, directory)
        shutil.rmtree(aside, ignore_errors=True)


# ---- the cache --------------------------------------------------------------------------------------

def default_cache_root() -> Path:
    """``$SHARDTUNE_CACHE``, else ``~/.cache/shardtune/data``."""
    env = os.environ.get("SHARDTUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "shardtune" / "data"


def cache_key(*parts: str) -> str:
    """A directory name for a tokenized data set: sha256 of the parts (order matters), 24 hex digits."""
    h = hashlib.sha256()
    for part in parts:
        data = str(part).encode()
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: ("ab", "c") != ("a", "bc")
        h.update(data)
    return h.hexdigest()[:24]


def is_complete(directory: str | Path) -> bool:
    """True if ``directory`` holds a finished store of the current format version."""
    try:
        meta = json.loads((Path(directory) / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("version") == FORMAT_VERSION


def _proc_start(pid: int) -> str | None:
    """The process's start time (Linux /proc), to tell a live builder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_info() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()), "time": time.time()}


def _read_lock(lock: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(lock.read_text())
        return info if isinstance(info, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or garbage


def _holder_dead(info: dict[str, Any] | None, lock: Path) -> bool:
    """The lock's builder is known to be gone: same host and its pid is dead (or reused)."""
    if info is None:
        return False
    if not info:  # unreadable: stale once it has been like that for a minute
        try:
            return time.time() - lock.stat().st_mtime > 60
        except OSError:
            return False
    if info.get("host") != socket.gethostname():
        return False  # cannot tell for another machine
    try:
        pid = int(info.get("pid", -1))
    except (TypeError, ValueError):
        pid = -1
    if pid <= 0 or not _alive(pid):
        return True
    start = info.get("start")
    return start is not None and _proc_start(pid) not in (None, start)


def _try_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(_lock_info(), f)
    return True


def _take_over(lock: Path) -> None:
    """Remove a stale lock; of several processes doing this at once exactly one rename succeeds."""
    grave = lock.with_name(f"{lock.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    with contextlib.suppress(FileNotFoundError):
        os.replace(lock, grave)
        grave.unlink()


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "an unknown process"
    return f"pid {info.get('pid')} on {info.get('host')}"


def cached_store(key: str, cache_root: str | Path, rows_factory: Callable[[], Iterable[RowItem]],
                 encoder: Callable[[dict[str, Any]], tuple[list[int], list[bool]]], *, num_proc: int, strict: bool,
                 rank_is_builder: bool, wait_timeout_s: float = 24 * 3600, poll_s: float = 2.0,
                 chunk_size: int = 1024, extra_meta: dict[str, Any] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> tuple[TokenStore, bool]:
    """The TokenStore at ``cache_root/key``: ``(store, True)`` if it was there, else built or waited for.

    ``rank_is_builder`` (the caller's choice, normally local rank 0 of each node): this process builds a
    missing store, holding ``cache_root/key.lock`` (created with O_EXCL, holding pid/host) so two runs
    sharing a cache never build one key twice; a lock whose process died on this host is taken over,
    one from another host is waited for. Other processes poll for the finished directory (no
    torch.distributed collective: tokenizing can take longer than their timeouts) and fail fast if the
    builder on this host died or reported a failure. Either kind gives up after ``wait_timeout_s``.
    Returns ``(store, hit)``; hit is False for the builder that built it and for anyone who had to wait.
    """
    cache_root = Path(cache_root)
    final = cache_root / key
    if is_complete(final):
        return TokenStore(final), True
    lock = cache_root / f"{key}.lock"
    failed = cache_root / f"{key}.failed"
    deadline = time.monotonic() + wait_timeout_s
    if not rank_is_builder:
        return _wait_for(final, lock, failed, deadline, wait_timeout_s, poll_s), False
    cache_root.mkdir(parents=True, exist_ok=True)
    delay = 0.05
    while not _try_lock(lock):
        if is_complete(final):
            return TokenStore(final), False
        info = _read_lock(lock)
        if _holder_dead(info, lock):
            _take_over(lock)
            continue
        if time.monotonic() > deadline:
            raise ShardtuneError(f"gave up after {wait_timeout_s:.0f} s waiting for {_describe(info)} to finish "
                                 f"tokenizing {final}; if no run is building it, delete {lock}")
        time.sleep(delay)
        delay = min(poll_s, delay * 2)
    try:
        if is_complete(final):  # built by another run between our check and the lock
            return TokenStore(final), False
        failed.unlink(missing_ok=True)
        for leftover in cache_root.glob(f".{key}.tmp-*"):  # of crashed builds; we hold the key's lock
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            store = build_store(rows_factory(), encoder, final, num_proc=num_proc, strict=strict,
                                chunk_size=chunk_size, extra_meta=extra_meta, progress=progress)
        except BaseException as err:
            with contextlib.suppress(OSError):
                failed.write_text(json.dumps({**_lock_info(), "error": f"{type(err).__name__}: {err}"}))
            raise
        return store, False
    finally:
        lock.unlink(missing_ok=True)


def _wait_for(final: Path, lock: Path, failed: Path, deadline: float, timeout_s: float, poll_s: float) -> TokenStore:
    started = time.time()
    # A failure report or a dead builder only counts once it has lasted this long: when another run's
    # builder failed or died, this run's builder takes the lock over within poll_s and tries again.
    grace = 2 * poll_s + 1.0
    trouble_since: float | None = None
    delay = 0.05
    while True:
        if is_complete(final):
            return TokenStore(final)
        holder = _read_lock(lock)
        trouble = None
        if holder and _holder_dead(holder, lock):
            trouble = (f"the process tokenizing {final} ({_describe(holder)}) died without finishing; "
                       "run again to rebuild it")
        elif holder is None:
            try:
                info = json.loads(failed.read_text())
                if float(info.get("time", 0)) >= started - grace:
                    trouble = (f"tokenizing {final} failed in the building process ({_describe(info)}): "
                               f"{info.get('error')}")
            except (OSError, ValueError, AttributeError, TypeError):
                pass
        if trouble is None:
            trouble_since = None
        elif trouble_since is None:
            trouble_since = time.monotonic()
        elif time.monotonic() - trouble_since >= grace:
            raise ShardtuneError(trouble)
        if time.monotonic() > deadline:
            raise ShardtuneError(f"gave up after {timeout_s:.0f} s waiting for {final} to be tokenized by the "
                                 f"building process ({_describe(holder)}); is local rank 0 still tokenizing? "
                                 "raise the wait timeout or tokenize first with one process")
        time.sleep(delay if trouble is None else min(delay, 0.2))
        delay = min(poll_s, delay * 2)
