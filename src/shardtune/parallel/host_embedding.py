"""`peft.offload_embedding`: a frozen input embedding kept in host memory, looked up there.

Under LoRA / QLoRA the input embedding trains nothing, yet its table sits on the GPU for the whole run: 1 GB of the
Llama-3-8B shape in bf16 (128,256 x 4,096), 2.1 GB of the 70B's. Its forward is a gather of one row per token, so
the rows a micro-batch needs (tokens x hidden: 32 MiB at 4,096 tokens of the 8B) are gathered on the host into
pinned memory and copied to the GPU behind the queued work. The token ids are read from the host copy the loop made
the batch from (data.to_device keeps it: `Batch.host_input_ids`), so the host never waits for the GPU; a call
without it (ids only on the GPU) copies them back first, which waits. Unsloth's `offload_embedding=True` is the same
trade (it copies the ids back each call).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from shardtune.errors import ShardtuneError
from shardtune.parallel import TIED_EMBEDDING
from shardtune.parallel.prepare import power_of_two_pieces

# The smallest piece of rows looked up and copied in at once (below it, one piece for the rest).
PIECE_ROWS = 1024


class HostEmbedding:
    """The `forward` of a frozen nn.Embedding whose table now lives on the host; set as the module's `forward`
    attribute (the module and its weight keep their names, so state dicts and exports see them). `ids`: the next
    call's token ids on the host, handed in by the backend before each forward."""

    def __init__(self, module: nn.Embedding, device: torch.device) -> None:
        self.module, self.device = module, device
        self.ids: torch.Tensor | None = None
        self.waited = 0  # calls that had to copy their ids back from the GPU

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, self.ids = self.ids, None
        if ids is None or ids.shape != input_ids.shape:
            ids = input_ids.cpu()
            if input_ids.device.type != "cpu":
                self.waited += 1
                if self.waited == 1:  # once a run: the step stays right, only slower (the host idles each call)
                    warnings.warn("peft.offload_embedding: a forward came without the batch's host copy of its token "
                                  "ids, so the lookup copied them back from the GPU and waited for it; feed batches "
                                  "made by shardtune.data.to_device (Batch.host_input_ids), or set "
                                  "peft.offload_embedding=false", stacklevel=2)
        weight, flat = self.module.weight, ids.reshape(-1)
        out = torch.empty((flat.numel(), weight.shape[1]), dtype=weight.dtype, device=self.device)
        start = 0
        # in power-of-two pieces of rows: torch's pinned allocator rounds each block up to a power of two (327,680
        # tokens of the 8B shape would hold 4 GiB for 2.5)
        for count in power_of_two_pieces(flat.numel(), PIECE_ROWS):
            rows = torch.empty((count, weight.shape[1]), dtype=weight.dtype, pin_memory=self.device.type == "cuda")
            with torch.no_grad():  # a frozen table (offload_embedding refuses one that trains)
                torch.index_select(weight, 0, flat[start:start + count], out=rows)
            out[start:start + count].copy_(rows, non_blocking=True)
            start += count
        return out.view(*ids.shape, weight.shape[1])


def offload_embedding(model: nn.Module, device: torch.device, *, required: bool = True) -> HostEmbedding | None:
    """Move `model`'s frozen input embedding to host memory and look it up there (HostEmbedding, returned). An
    embedding that trains, is tied to the LM head (which multiplies by it on the GPU), or is not a plain
    nn.Embedding (a scaled one, Gemma's, does more in its forward) stays: refused in one line when `required`
    (peft.offload_embedding: true), else None (auto)."""
    module = model.get_input_embeddings()
    why = stays_on_gpu(module, model.get_output_embeddings())
    if why:
        if required:
            raise ShardtuneError(why)
        return None
    module.weight = nn.Parameter(module.weight.detach().to("cpu"), requires_grad=False)
    host = HostEmbedding(module, device)
    module.forward = host
    return host


def stays_on_gpu(module: nn.Module, head: nn.Module | None) -> str:
    """Why the input embedding `module` cannot be looked up on the host ("" where it can)."""
    if type(module) is not nn.Embedding or module.max_norm is not None:
        return (f"peft.offload_embedding: the input embedding is a {type(module).__name__}, whose forward does more "
                "than a lookup; set peft.offload_embedding=false")
    if module.weight.requires_grad:
        return ("peft.offload_embedding: the input embedding trains here (full fine-tuning or an adapter on it); it "
                "can be kept on the host only frozen; set peft.offload_embedding=false")
    if head is not None and head.weight is module.weight:
        return TIED_EMBEDDING
    return ""
