"""Low-level helpers every package may use: JSON-able values, durable directory entries, writing safetensors
files in shards, and gathering a sharded tensor. (Folders written for users are swapped into place under the
rule of checkpoint/outdir.py.)"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardtune.errors import error_chain


def jsonable(obj: Any) -> Any:
    """Scalars held as tensors (a tensor learning rate, as torchao's AdamW8bit keeps) -> Python numbers."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def fsync_dir(path: Path, *, required: bool = True) -> None:
    """Make a rename or new file inside `path` durable (the directory entry itself is synced). Not every file
    system (or OS) lets a directory be fsynced: with required=False, such a failure is ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if required:
            raise


# A full disk, and a full quota (which users meet as the same thing on shared file systems).
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")


def disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it came from, says the disk (or quota) is full. Libraries wrap the OSError:
    torch's zip writer raises "unexpected pos" with the ENOSPC as its context, DCP re-raises every rank's failure
    as text in a CheckpointException."""
    return any((isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS) or any(t in str(e) for t in _NO_SPACE_TEXTS)
               for e in error_chain(err))


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we walk
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def free_bytes(path: Path) -> int | None:
    """Free bytes (for this user) on the file system of `path`, or of its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(nbytes: int | None) -> str:
    """1234567 -> '1.2 MB' (decimal units, as df -H and file managers show them)."""
    if nbytes is None:
        return "unknown"
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:,} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split tensors, in order, into files of at most max_bytes (a larger tensor gets its own file)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def umask() -> int:
    """The process's file-creation mask, read without changing it (os.umask can only swap it, which would leave
    files that another thread creates meanwhile world-writable)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path | str,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the file's mode what any other file gets (0666 less the umask): save_file
    writes through a private temporary file and leaves mode 0600, which other users of a shared model folder
    cannot read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())


def write_safetensors(out: Path, sizes: list[tuple[str, int]], fetch: Callable[[str], torch.Tensor | None],
                      max_shard_bytes: int) -> None:
    """Write tensors, in order, into safetensors files of at most max_shard_bytes (+ index if several).

    `fetch(name)` gives the CPU tensor to write, or None on a rank that only joins the collectives;
    a rank that gets None for every tensor writes nothing.
    """
    shards = plan_shards(sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    total = 0
    failed: Exception | None = None
    for file, shard in zip(names, shards, strict=True):
        buf = {name: t for name in shard if (t := fetch(name)) is not None}
        if buf and failed is None:
            try:
                save_safetensors(buf, out / file, metadata={"format": "pt"})
            except Exception as err:  # raised after the loop: the other ranks wait in fetch's gathers for this one
                failed = err
            weight_map.update(dict.fromkeys(buf, file))
            total += sum(t.numel() * t.element_size() for t in buf.values())
    if failed is not None:
        raise failed
    if weight_map and len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: its whole tensor on every rank; a plain tensor as it is (detached)."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t
