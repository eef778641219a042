"""One run per output directory: an exclusive OS file lock on OUTPUT_DIR/.lock.

Two runs writing into one directory produce checkpoints whose manifests lack their shards and
interleaved metrics. `shardtune train` (the launcher, or rank 0 when torchrun started the workers
directly) holds `flock` on the lock file for the life of the run; the kernel drops it when that process
ends however it ends (kill -9 too), so a stale lock never blocks the next run. The file holds the
holder's pid and host, so a refused run can say which one is running.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from shardtune.errors import ShardtuneError

LOCK = ".lock"
# Set by the process that holds the lock to the directory it holds, so the workers it starts (which inherit
# the environment, not the descriptor) do not try to take it again.
LOCK_ENV = "SHARDTUNE_RUN_LOCK"
_held: dict[str, int] = {}  # directory -> descriptor, for this process's life


def lock_run_dir(out: Path) -> None:
    """Take OUTPUT_DIR's lock for this process (creating the directory), or raise naming the run that holds
    it. Idempotent within a process; released when the process ends (or by `release_run_dir`)."""
    key = str(out.resolve())
    if key in _held or os.environ.get(LOCK_ENV) == key:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (O_CLOEXEC)
    except OSError as err:
        raise ShardtuneError(f"train.output_dir {str(out)!r}: cannot create it or its lock file "
                             f"({err.strerror}); choose a writable folder with --output-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said which"
        os.close(fd)
        raise ShardtuneError(f"{out} is in use by another shardtune run ({holder}); wait for it to end, or give "
                             "this run another --output-dir") from None
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {stamp}: "
                  f"{' '.join(sys.argv[:3])}\n".encode(), 0)
    _held[key] = fd
    os.environ[LOCK_ENV] = key


def release_run_dir(out: Path) -> None:
    """Give the lock back before the process ends (in-process callers that run several trainings)."""
    key = str(out.resolve())
    fd = _held.pop(key, None)
    if fd is not None:
        os.close(fd)
    if os.environ.get(LOCK_ENV) == key:
        del os.environ[LOCK_ENV]
