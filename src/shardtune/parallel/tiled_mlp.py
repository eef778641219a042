"""`parallel.tiled_mlp`: each decoder block's MLP run over tiles of the sequence, each tile under its own checkpoint.

An MLP treats every token alone, so it can run on a piece of the tokens at a time. Under full checkpointing the
recompute of one block is what bounds the longest sequence (issue 17: "keeping the recompute's working set
chunked"), and the MLP holds most of it: gate, up, SiLU and product outputs, tokens x f each (4pf per token;
14,336-wide on the Llama-3-8B shape), then its backward's 2pf more: 52 GiB at 327,680 tokens of the 8B shape
against the rest of the block's 26. Tiled, the block keeps only the MLP's input (p x h per token, shared with the
tiles' checkpoints), and each tile's intermediates live only while that tile's backward runs: its forward runs
once more there (one more MLP forward per step, about 2% of a 327,680-token step, where attention dominates).
Snowflake's Arctic Long Sequence Training (DeepSpeed's TiledMLP) and Unsloth's tiled MLP do the same; this one is
torch's non-reentrant checkpoint per tile, so it composes with the block's own checkpoint, the activation
offload's hooks and any MLP forward (Liger's SwiGLU, LoRA and QLoRA layers), and the gradients reach the weights
through autograd as usual: each weight's gradient is summed over the tiles before it reaches the weight, so
FSDP2's reduce-scatter and DeepSpeed's gradient hooks see it once (DeepSpeed's own TiledMLP must tell ZeRO to
wait for the last tile instead; tests/dist/test_deepspeed.py).

Under compile the tiles run eagerly (a graph break around the MLP): a compiled graph's recompute of every tile
would be scheduled by Inductor, not one tile at a time, so `parallel.checkpoint_in_compile` takes the checkpoint
around the compiled blocks (parallel.traces_checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.errors import ShardtuneError


class TiledForward:
    """An MLP's `forward` over tiles of at most `tokens` tokens (the batch and sequence dimensions flattened), each
    under torch's non-reentrant checkpoint where a backward will follow. Held as the module's `forward` attribute,
    naming the module as an attribute (a deep copy of the model tiles each copy's own MLP, as
    prepare.CheckpointedForward does); `function` is what the module's forward was (its class's, or one bound on
    the instance by Liger's patching)."""

    def __init__(self, module: nn.Module, tokens: int) -> None:
        bound = module.__dict__.get("forward")
        self.module, self.tokens = module, tokens
        self.function = bound.__func__ if bound is not None else type(module).forward

    @torch._dynamo.disable  # the tiles one at a time, eagerly (see the module's docstring)
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.size(-1))
        if flat.size(0) <= self.tokens:
            return self.function(self.module, hidden)
        tiles = flat.split(self.tokens)
        if torch.is_grad_enabled() and self.module.training:
            outs = [checkpoint(self.function, self.module, tile, use_reentrant=False) for tile in tiles]
        else:
            outs = [self.function(self.module, tile) for tile in tiles]
        out = torch.cat(outs)
        return out.view(*hidden.shape[:-1], out.size(-1))


def tile_mlps(blocks: list[nn.Module], tokens: int) -> None:
    """Give each decoder block's MLP (its `mlp` submodule: Llama, Mistral, Qwen, Gemma and the like) a TiledForward
    of `tokens` tokens. A block without one is refused in one line: tiling a mixture of experts' router, or an
    unknown layout, would change what it computes."""
    for index, block in enumerate(blocks):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module) or not type(mlp).__name__.endswith("MLP"):
            raise ShardtuneError(f"parallel.tiled_mlp: decoder block {index} ({type(block).__name__}) has no dense "
                                 f"`mlp` module (found {type(mlp).__name__}); set parallel.tiled_mlp=null")
        if not isinstance(mlp.__dict__.get("forward"), TiledForward):
            mlp.forward = TiledForward(mlp, tokens)
