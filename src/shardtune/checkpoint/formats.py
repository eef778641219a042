"""The checkpoint format seam: one small object per on-disk format of the model and optimizer state.

  dcp        (dcp_files.DCPFormat)            torch.distributed.checkpoint: reshards, writes in the background
  deepspeed  (deepspeed_files.DeepSpeedFormat) DeepSpeed's own files: same number of processes, written in sync

A backend names its format (parallel.BACKENDS[...].checkpoint_format); the Checkpointer (checkpointer.py)
keeps what is the same for every format (layout.py: directory, manifest, atomic rename; retention, RNG)
and never asks which format it has; the manifest records the format's name, so export and resume read
any checkpoint with the format that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardtune.checkpoint.layout import read_manifest
from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.config import CheckpointConfig
    from shardtune.dist import DistContext


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of a checkpoint, read only when load() is called (a new CPU tensor each time)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Written:
    """What a format's write hands back. Both None: written, and renamed into place on rank 0, before it
    returned. Else `staging` completes when the state has been copied out (the optimizer may then change
    it), and `done` when every rank's files are written and (on rank 0) the checkpoint is in place."""

    staging: Future | None = None
    done: Future | None = None


class Format(Protocol):
    name: str  # as the manifest records it
    reshardable: bool  # resumes on any number of processes (and across strategies)
    asynchronous: bool  # can write in the background while training goes on

    def start(self, cfg: CheckpointConfig, ctx: DistContext, root: Path) -> None:
        """Every rank, before the first save."""

    def write(self, backend: Any, tmp: Path, final: Path, info: dict[str, Any]) -> Written:
        """Collective: the backend's model and optimizer state into `tmp`; once every rank has written, rank 0
        finalizes (layout.finalize: manifest with `info`, rename to `final`)."""

    def read(self, backend: Any, path: Path) -> None:
        """Collective: restore the backend's model and optimizer state from checkpoint `path`."""

    def resume_on(self, path: Path, saved_world: int, world: int) -> None:
        """Refuse (one line, with the fix) to resume a checkpoint of `saved_world` processes on `world`."""

    def tensors(self, path: Path) -> dict[str, LazyTensor]:
        """Parameter name -> LazyTensor of the model in checkpoint `path`, one process, bounded memory."""

    def close(self) -> None:
        """After the last save has finished: free what start and write kept."""


def _formats() -> dict[str, type[Format]]:
    # The implementations import this module's types: the table is built on first use.
    from shardtune.checkpoint.dcp_files import DCPFormat
    from shardtune.checkpoint.deepspeed_files import DeepSpeedFormat

    return {f.name: f for f in (DCPFormat, DeepSpeedFormat)}


def make_format(name: str) -> Format:
    """A fresh format object (formats keep per-run state, e.g. async staging buffers)."""
    return _formats()[name]()


def stored_format(path: Path) -> str:
    """The name of the format a complete checkpoint stores its tensors in (manifests written before the
    deepspeed backend carry none: "dcp")."""
    fmt = (read_manifest(path) or {}).get("format", "dcp")
    if fmt not in _formats():
        raise ShardtuneError(f"{path}: checkpoint format {fmt!r} is not one this shardtune reads "
                             f"({', '.join(_formats())})")
    return fmt


def check_resumable(path: Path, backend: str, world: int) -> None:
    """Refuse, before anything is built, a resume that the checkpoint's format cannot do with `backend` on
    `world` processes (all nodes)."""
    from shardtune.parallel import BACKENDS

    manifest = read_manifest(path) or {}
    stored = manifest.get("format", "dcp")
    if stored != BACKENDS[backend].checkpoint_format:
        writer = next((name for name, spec in BACKENDS.items() if spec.checkpoint_format == stored), stored)
        raise ShardtuneError(f"checkpoint {path} was written by the {writer} backend and cannot be resumed with "
                             f"parallel.backend={backend}; resume with parallel.backend={writer}, or "
                             f"`shardtune export {path} DIR` and start a new run from DIR")
    make_format(stored).resume_on(path, int(manifest.get("world_size", world)), world)
