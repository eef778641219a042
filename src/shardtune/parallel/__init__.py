"""Backends behind one seam (see base.Backend). The loop never asks which one it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shardtune.dist import DistContext
from shardtune.parallel.base import Backend
from shardtune.parallel.fsdp2 import FSDP2Backend

if TYPE_CHECKING:
    from shardtune.config import Config


def _fsdp2(cfg: Config, ctx: DistContext) -> Backend:
    return FSDP2Backend(cfg.parallel, cfg.train.precision, ctx)


def _deepspeed(cfg: Config, ctx: DistContext) -> Backend:
    from shardtune.parallel.deepspeed import DeepSpeedBackend
    from shardtune.parallel.ds_config import deepspeed_config

    ds = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, ctx.world)
    return DeepSpeedBackend(cfg.parallel, cfg.train.precision, ctx, ds)


# Each backend takes the sections it needs from the run's config.
BACKENDS: dict[str, Callable[[Config, DistContext], Backend]] = {
    "fsdp2": _fsdp2,
    "deepspeed": _deepspeed,
}


def make_backend(cfg: Config, ctx: DistContext) -> Backend:
    return BACKENDS[cfg.parallel.backend](cfg, ctx)
