"""The backend seam: the training loop drives any backend through this interface alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from shardtune.config import OptimConfig
    from shardtune.data import Batch
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
