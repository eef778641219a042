"""The backend seam: the training loop drives any backend through this interface alone (what each backend
supports and how to build it is its BackendSpec, in spec.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from shardtune.data import Batch
    from shardtune.models.weights import WeightSource


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # train.precision -> compute

# (logits, labels) -> the sum of token losses (train.loss.token_loss_sum), handed to a backend by the loop.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class OptimizerFactory(Protocol):
    """Builds the run's optimizer over the parameters a backend holds (train.optim.OptimizerFactory)."""

    def __call__(self, named_params: Iterable[tuple[str, nn.Parameter]], device: torch.device, *,
                 sharded_fp16: bool = False, on_host: bool = False) -> torch.optim.Optimizer: ...


class Backend(Protocol):
    """Takes a meta-device model; returns something the loop can drive. Made by BackendSpec.make with the
    loss it computes (LossFn).

    setup:            apply activation checkpointing / compile, shard, load weights, build the optimizer with
                      `make_optimizer`.
    optimizer:        the optimizer whose param groups carry the LR: the loop's schedule sets it there.
    forward_backward: loss of one micro-batch divided by `normalizer` (target tokens of the whole
                      step on all ranks), backpropagated; returns the detached loss contribution.
    step:             clip, optimizer step, zero grads; returns the global grad norm. step_applied: whether
                      it updated the model (an fp16 overflow skips the update, and so the schedule's step).
    state_dict:       model + optimizer tensors for a DCP checkpoint (load_state_dict restores them);
    extra_state:      the JSON-able rest the backend owns (the loss scaler's state).
    forward:          logits for evaluation (no grad).
    full_tensor:      collective: a parameter's whole tensor, however the backend shards it (for export).
    module:           the unwrapped model (for export).
    fused_loss:       whether the model's forward computes the summed loss itself when given labels (Liger's fused
                      linear + cross-entropy, models/liger.install_fused_loss; set by the loop before setup).
    Its checkpoint format (BackendSpec.checkpoint_format) drives it: DCP saves `state_dict()`, DeepSpeed's
    format calls the engine's `save_native(dir, tag)` / `load_native(dir, tag)`.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    fused_loss: bool

    def setup(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None,
              make_optimizer: OptimizerFactory) -> None: ...

    def forward_backward(self, batch: Batch, normalizer: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        ...

    def step(self) -> torch.Tensor: ...

    # step_skipped (optional attribute): the last step() left the weights unchanged because its gradients were
    # not finite (fsdp2 with skip_nonfinite); the loop counts it. Backends without it never skip.
    # skip_flag (optional attribute): when set after a step(), step_skipped is not known yet: the flag's first
    # value (> 0: skipped) is, once read; the loop reads it after queueing the next step's kernels.

    @property
    def step_applied(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...  # tensors for DCP: {"model": ..., "optim": ...}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def extra_state(self) -> dict[str, Any]: ...  # JSON-able: {"scaler": ...}

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def train(self, mode: bool = True) -> None: ...

    def forward(self, batch: Batch) -> torch.Tensor: ...

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor: ...
