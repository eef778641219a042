"""What every backend does to the model before sharding it, in the fixed order: activation
checkpointing, then torch.compile of each decoder block (adapters are already in place).

`parallel.activation_checkpointing`:
- full: each decoder block keeps only its input; backward runs the block's forward again.
- selective: per-op selective checkpointing as torchtitan's `selective_ac_option: op` does: the block keeps the
  outputs of its attention kernel and of every other matmul (q, v, gate and down projections: the first, third,
  ... of the block), and recomputes the rest (k, o and up projections, norms, RoPE, SiLU) in backward. About a
  third of a block's forward matmul FLOPs are recomputed instead of all of them, for about a third of the
  activations of no checkpointing (plan/memory.py, plan/speed.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from shardtune.config import ParallelConfig

# Ops whose outputs selective checkpointing saves (torchtitan's _save_list for one device: matmuls, the attention
# kernels). Every other matmul is recomputed, which halves what the matmul outputs cost in memory.
_aten = torch.ops.aten
SAVED_OPS = {_aten.mm.default, _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default}


def selective_policy(counts: dict[str, int]) -> Any:
    """The per-op policy of one checkpointed call: save the attention kernel's output and every other matmul's
    (the 1st, 3rd, ...: counted separately in forward and in the recompute, so both make the same choices)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == _aten.mm.default:
            counts[key] += 1
            save = counts[key] % 2 == 1
        else:
            save = func in SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context() -> Any:
    """torch.utils.checkpoint's context_fn for one checkpointed call (a fresh matmul count each call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(defaultdict(int)))


def checkpoint_kwargs(mode: str) -> dict[str, Any]:
    """Keyword arguments for torch.utils.checkpoint.checkpoint (through transformers' per-block checkpointing).
    Non-reentrant checkpointing composes with FSDP2, DeepSpeed and compile; it keeps parameter names."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_context
    return kwargs


# Saved tensors below this size stay on the device: their copies would cost more in latency than they free.
OFFLOAD_MIN_BYTES = 1 << 20


class ActivationOffload(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu (a saved tensor copied to host memory in forward, pinned on GPUs, and back in
    backward) for activations only: parameters and their views (FSDP2's gathered weights, transposed, that a
    matmul saves) and tensors under `min_bytes` stay where they are. `moved_bytes` counts what went to the host
    since it was made."""

    def __init__(self, device_type: str, min_bytes: int = OFFLOAD_MIN_BYTES) -> None:
        super().__init__(pin_memory=device_type == "cuda", device_type=device_type)
        self.moved_bytes = 0
        copy_out, copy_in = self.pack_hook, self.unpack_hook

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            size = tensor.numel() * tensor.element_size()
            if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or size < min_bytes:
                return False, tensor
            self.moved_bytes += size
            return True, copy_out(tensor)

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            moved, value = packed
            return copy_in(value) if moved else value

        self.pack_hook, self.unpack_hook = pack, unpack


def offload_activations(model: nn.Module, blocks: list[nn.Module], device_type: str,
                        min_bytes: int = OFFLOAD_MIN_BYTES) -> ActivationOffload:
    """parallel.activation_offload: the offload hooks are on while the decoder (the module holding the blocks)
    runs its forward, so the blocks' saved tensors go to the host, and with full checkpointing the blocks'
    inputs, which non-reentrant checkpointing saves through autograd before its own hooks take over. The LM
    head and the loss stay outside: their tensors are needed at once in backward (the logits are the largest)."""
    decoder = next(m for m in model.modules()
                   if any(isinstance(c, nn.ModuleList) and any(b is blocks[0] for b in c) for c in m.children()))
    offload = ActivationOffload(device_type, min_bytes)
    decoder.register_forward_pre_hook(lambda *_: offload.__enter__())
    decoder.register_forward_hook(lambda *_: offload.__exit__(None, None, None), always_call=True)
    return offload


def checkpoint_and_compile(model: nn.Module, blocks: list[nn.Module], parallel: ParallelConfig,
                           device_type: str = "cpu") -> ActivationOffload | None:
    """Checkpointing, then compile of each block; with parallel.activation_offload the offload hooks (returned)."""
    offload = offload_activations(model, blocks, device_type) if parallel.activation_offload else None
    if parallel.activation_checkpointing != "none":
        kwargs = checkpoint_kwargs(parallel.activation_checkpointing)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if parallel.compile:
        for block in blocks:
            block.compile()
    return offload
