"""Backends behind one seam (see base.Backend). The loop never asks which one it has."""

from __future__ import annotations

from collections.abc import Callable

from shardtune.config import ParallelConfig
from shardtune.dist import DistContext
from shardtune.parallel.base import Backend
from shardtune.parallel.fsdp2 import FSDP2Backend

BACKENDS: dict[str, Callable[[ParallelConfig, str, DistContext], Backend]] = {
    "fsdp2": FSDP2Backend,
}


def make_backend(parallel: ParallelConfig, precision: str, ctx: DistContext) -> Backend:
    return BACKENDS[parallel.backend](parallel, precision, ctx)
