"""What every backend does to the model before sharding it, in the fixed order: activation
checkpointing, then torch.compile of each decoder block (adapters are already in place)."""

from __future__ import annotations

from torch import nn

from shardtune.config import ParallelConfig


def checkpoint_and_compile(model: nn.Module, blocks: list[nn.Module], parallel: ParallelConfig) -> None:
    if parallel.activation_checkpointing == "full":
        # Non-reentrant checkpointing composes with FSDP2, DeepSpeed and compile; it keeps parameter names.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parallel.compile:
        for block in blocks:
            block.compile()
