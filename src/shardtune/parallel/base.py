"""The backend seam: the training loop drives any backend through this interface alone, and
`parallel.BACKENDS` holds, per backend, what it supports and how to build it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.config import Config, OptimConfig, ParallelConfig
    from shardtune.data import Batch
    from shardtune.dist import DistContext
    from shardtune.models.weights import WeightSource


class Backend(Protocol):
    """Takes a meta-device model and the optimizer settings; returns something the loop can drive.

    setup:            apply activation checkpointing / compile, shard, load weights, build optimizer.
    forward_backward: loss of one micro-batch divided by `normalizer` (target tokens of the whole
                      step on all ranks), backpropagated; returns the detached loss contribution.
    step:             clip, optimizer and scheduler step, zero grads; returns the global grad norm.
    state_dict:       model + optimizer tensors for a DCP checkpoint (load_state_dict restores them);
    extra_state:      the JSON-able rest (LR schedule, loss scaler).
    forward:          logits for evaluation (no grad).
    full_tensor:      collective: a parameter's whole tensor, however the backend shards it (for export).
    module:           the unwrapped model (for export).
    checkpoint_format: "dcp" (the loop's checkpointer saves `state_dict()` with DCP) or "deepspeed"
                      (the backend writes its engine's own files: `save_native(dir)` / `load_native(dir)`).
    """

    module: nn.Module

    def setup(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None, optim: OptimConfig,
              lr: float, total_steps: int) -> None: ...

    def forward_backward(self, batch: Batch, normalizer: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        ...

    def step(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...  # tensors for DCP: {"model": ..., "optim": ...}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def extra_state(self) -> dict[str, Any]: ...  # JSON-able: LR schedule, loss scaler

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def train(self, mode: bool = True) -> None: ...

    def forward(self, batch: Batch) -> torch.Tensor: ...

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor: ...

    @property
    def lr(self) -> float: ...


# Config keys a backend declares its support for (BackendSpec.supports), with where each value is read.
SUPPORT_KEYS: dict[str, Callable[[Config], str]] = {
    "parallel.strategy": lambda cfg: cfg.parallel.strategy,
    "parallel.offload": lambda cfg: cfg.parallel.offload,
    "peft.method": lambda cfg: cfg.peft.method,
    "optim.name": lambda cfg: cfg.optim.name,
    "train.precision": lambda cfg: cfg.train.precision,
}


@dataclass(frozen=True)
class BackendSpec:
    """One entry of `parallel.BACKENDS`, declared in the backend's own module.

    supports:  config key (SUPPORT_KEYS) -> the values this backend runs; the planner picks among them.
    refusals:  (key, value) -> the one-line message (with its fix) for each value it does not run.
    make:      builds the backend for a run: (cfg, ctx) -> Backend.
    check:     its other refusals: (cfg, world or None, device type or None); world = processes per node.
    describe:  (cfg, world) -> how it runs the strategy, as `shardtune plan` prints it.
    checkpoint_format: the on-disk format of its checkpoints (a name of checkpoint's formats).
    param_shards: (parallel, world) -> over how many ranks it splits each parameter at rest (1: every rank
               holds whole parameters); QLoRA sizes its NF4 blocks for it.
    """

    supports: dict[str, tuple[str, ...]]
    refusals: dict[tuple[str, str], str]
    make: Callable[[Config, DistContext], Backend]
    check: Callable[[Config, int | None, str | None], None]
    describe: Callable[[Config, int], str]
    checkpoint_format: str
    param_shards: Callable[[ParallelConfig, int], int]

    def refuse_unsupported(self, cfg: Config) -> None:
        """The first setting this backend does not run, as one line with its fix."""
        for key, allowed in self.supports.items():
            value = SUPPORT_KEYS[key](cfg)
            if value not in allowed:
                raise ShardtuneError(self.refusals[(key, value)])
