"""What a backend declares about itself (BackendSpec), read by `plan` and `validate` without importing torch:
`parallel.BACKENDS` maps `parallel.backend` to one per backend module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.config import Config, ParallelConfig
    from shardtune.dist import DistContext
    from shardtune.parallel.base import Backend, LossFn

# Config keys a backend declares its support for (BackendSpec.supports), with where each value is read.
SUPPORT_KEYS: dict[str, Callable[[Config], str]] = {
    "parallel.strategy": lambda cfg: cfg.parallel.strategy,
    "parallel.offload": lambda cfg: cfg.parallel.offload,
    "peft.method": lambda cfg: cfg.peft.method,
    "optim.name": lambda cfg: cfg.optim.name,
    "train.precision": lambda cfg: cfg.train.precision,
    "parallel.activation_offload": lambda cfg: "true" if cfg.parallel.activation_offload else "false",
    # auto is checked as true: where it keeps weights whole (fsdp2 on one process) explicit false runs too
    "parallel.shard_frozen": lambda cfg: "false" if cfg.parallel.shard_frozen is False else "true",
    # auto is checked as fsdp2: it takes direct only on the FSDP2 backend, where it runs (fsdp2.runs_direct)
    "parallel.one_gpu": lambda cfg: "direct" if cfg.parallel.one_gpu == "direct" else "fsdp2",
    "train.float8": lambda cfg: "false" if cfg.train.float8 is False else cfg.train.float8,
    "parallel.tiled_mlp": lambda cfg: "false" if cfg.parallel.tiled_mlp is None else "true",
}


class CheckFn(Protocol):
    def __call__(self, cfg: Config, world: int | None = None, device: str | None = None, *,
                 candidate: bool = False, per_node: int | None = None) -> None: ...


class DescribeFn(Protocol):
    def __call__(self, cfg: Config, world: int, *, per_node: int | None = None) -> str: ...


@dataclass(frozen=True)
class BackendSpec:
    """One entry of `parallel.BACKENDS`, declared in the backend's own module.

    supports:  config key (SUPPORT_KEYS) -> the values this backend runs; the planner picks among them.
    refusals:  (key, value) -> the one-line message (with its fix) for each value it does not run.
    make:      builds the backend for a run: (cfg, ctx, loss) -> Backend.
    check:     its other refusals: (cfg, world or None, device type or None, *, candidate, per_node); world = every
               process of the job, per_node = one node's (None: world).
    describe:  (cfg, world, *, per_node) -> how it runs the strategy, as `shardtune plan` prints it.
    checkpoint_format: the on-disk format of its checkpoints (a name in checkpoint.formats).
    param_shards: (parallel, world) -> over how many ranks it splits each parameter at rest (1: every rank
               holds whole parameters); QLoRA sizes its NF4 blocks for it.
    keeps_float8_base: (parallel, world) -> whether LoRA's frozen float8 layers can be kept as their casts (the
               base whole on each GPU, outside the engine's sharding and casts): peft.keeps_float8_base's `whole`.
    """

    supports: dict[str, tuple[str, ...]]
    refusals: dict[tuple[str, str], str]
    make: Callable[[Config, DistContext, LossFn], Backend]
    check: CheckFn
    describe: DescribeFn
    checkpoint_format: str
    param_shards: Callable[[ParallelConfig, int], int]
    keeps_float8_base: Callable[[ParallelConfig, int], bool] = lambda parallel, world: False

    def refuse_unsupported(self, cfg: Config) -> None:
        """The first setting this backend does not run, as one line with its fix."""
        for key, allowed in self.supports.items():
            value = SUPPORT_KEYS[key](cfg)
            if value not in allowed:
                raise ShardtuneError(self.refusals.get((key, value), f"{key}: {value} is not a setting this backend "
                                                                      "runs; choose one of " + ", ".join(allowed)))
