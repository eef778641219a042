"""`peft.offload_head`: a frozen LM head kept in host memory, on the GPU only from a forward's start to its loss.

Under LoRA / QLoRA the LM head trains nothing, yet its weight sits on the GPU through backward, where the step's
peak is: 1 GB of the Llama-3-8B shape in bf16 (128,256 x 4,096). Liger's fused loss reads the head in forward only
(it makes the input's gradient there), so the head can go back to the host as soon as the loss is computed. Each
forward copies it in on a side stream, behind the decoder's first kernels (1 GB at 55 GB/s: ~19 ms against 0.7 s of
8B forward and backward at micro-batch 4), the compute stream waits for it after the decoder (the final norm's
output), and the forward's end drops the GPU copy. A plain loss's matmul keeps that copy for backward, where the
head's gradient of its input is made first: freed there instead. An untied head of plain nn.Linear only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtune.errors import ShardtuneError

TIED_HEAD = ("peft.offload_head: this model ties its LM head to the input embedding (tie_word_embeddings); set "
             "peft.offload_head=false")


class HostHead:
    """Hooks that keep `module`'s (a frozen nn.Linear) weight on the host and lend the model a GPU copy for each
    forward of `causal_lm` (from its start to its end; `decoder`'s output is where the compute stream waits)."""

    def __init__(self, causal_lm: nn.Module, decoder: nn.Module, module: nn.Linear, device: torch.device) -> None:
        self.module, self.device = module, device
        cuda = device.type == "cuda"
        # pinned on a GPU (copied in without staging), made once: no pageable copy of the head beside it first
        weight = module.weight.detach()
        host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=cuda).copy_(weight)
        self.host = nn.Parameter(host, requires_grad=False)
        module.weight = self.host
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.event: Any = None  # the copy in flight (CUDA), waited for once
        self.lent: nn.Parameter | None = None
        self.fetches = 0  # forwards that copied the head in (tests)
        causal_lm.register_forward_pre_hook(self._fetch)
        decoder.register_forward_hook(self._wait)
        causal_lm.register_forward_hook(self._release)

    def _fetch(self, *_: Any) -> None:
        if self.lent is not None:  # a forward inside a forward: the outer one lent it already
            return
        weight = torch.empty_like(self.host, device=self.device)  # on the compute stream: freed there
        if self.stream is None:
            weight.copy_(self.host)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the block's earlier users
            with torch.cuda.stream(self.stream):
                weight.copy_(self.host, non_blocking=True)
            self.event = self.stream.record_event()
        self.lent = nn.Parameter(weight, requires_grad=False)
        self.module.weight = self.lent
        self.fetches += 1

    def _wait(self, *_: Any) -> None:
        if self.event is not None:  # the copy is done before the head's first kernel (and before any reuse)
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None

    def _release(self, *_: Any) -> None:
        self._wait()
        self.module.weight, self.lent = self.host, None  # what autograd saved of the copy keeps it until backward


def offload_head(model: nn.Module, device: torch.device) -> HostHead:
    """Keep `model`'s frozen LM head on the host and lend it to each forward (HostHead, returned); refused in one
    line where the head trains, is tied to the input embedding or is not a plain bias-free nn.Linear."""
    head = model.get_output_embeddings()
    why = head_stays(head, model.get_input_embeddings())
    if why:
        raise ShardtuneError(why)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # inside PEFT's wrapper
    return HostHead(causal_lm, causal_lm.get_decoder(), head, device)


def head_stays(head: nn.Module | None, embedding: nn.Module | None) -> str:
    """Why the LM head `head` cannot be kept on the host ("" where it can)."""
    if type(head) is not nn.Linear or head.bias is not None:
        return (f"peft.offload_head: the LM head is a {type(head).__name__}, not a plain nn.Linear (an adapter on "
                "it, or another layout); set peft.offload_head=false")
    if head.weight.requires_grad:
        return ("peft.offload_head: the LM head trains here (full fine-tuning); it can be kept on the host only "
                "frozen; set peft.offload_head=false")
    if embedding is not None and head.weight is getattr(embedding, "weight", None):
        return TIED_HEAD
    return ""
