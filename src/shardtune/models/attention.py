"""The keyword arguments of the Hugging Face model call, with document masking for packed batches.

Unpacked batches (one example per right-padded row) get ``input_ids`` alone: causal attention is
exact for every position that carries loss, and SDPA stays on its fast ``is_causal`` kernel.

Packed batches (several examples per row, ``Batch.document_ids`` set) must not let an example attend
to the ones before it in the row. The mask is built explicitly, once per forward and outside the
decoder blocks, and passed as ``attention_mask`` in the form each attention implementation consumes:

  sdpa             4D bool ``[B, 1, S, S]``, True = attend.
  eager            4D additive float ``[B, 1, S, S]`` in the compute dtype: 0 = attend, finfo.min = not.
  flex_attention   a FlexAttention ``BlockMask`` with mask_mod ``doc[b,q] == doc[b,kv] and kv <= q``.
  flash_attention  no mask: ``cu_seq_lens_q/k`` + ``max_length_q/k`` (flash-attn's varlen kernel), with
                   ``position_ids`` for RoPE.

Transformers (checked on 5.17 and 5.24, ``masking_utils._preprocess_mask_arguments``) returns a 4D
tensor or a ``BlockMask`` given as ``attention_mask`` unchanged: no causal or padding mask is combined
with it, so it must be complete, which it is (document-causal). Its own packed-sequence detection from
``position_ids`` runs only when ``attention_mask`` is None AND there is no KV cache (``use_cache=False``),
which is why it is not relied on here. Padding (document -1) attends causally to the padding before it
and to itself, so no query row is ever fully masked (a fully masked row is NaN in SDPA, and NaN reaches
the gradients even where the loss ignores the position).

A custom 4D mask replaces the model's mask for every layer: sliding-window layers (Mistral, Qwen2 with
``use_sliding_window``, Gemma) then attend over the whole document, which only matters for documents
longer than the window.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.data.batch import Batch

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def attn_implementation(model: Any) -> str:
    """The attention kernel a built model uses (transformers' `config._attn_implementation`); it decides the
    mask a packed batch needs (model_inputs)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"


def model_inputs(batch: Batch, attn_implementation: str, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments for ``model(**kwargs, use_cache=False)``.

    ``dtype`` is the dtype attention scores are computed in (the FSDP2 ``param_dtype`` / autocast dtype);
    it is used only by the eager additive mask.
    """
    if batch.document_ids is None:
        return {"input_ids": batch.input_ids}
    if batch.position_ids is None:
        raise ValueError("a packed batch (document_ids set) needs position_ids")
    kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    docs = batch.document_ids
    if attn_implementation == "sdpa":
        kwargs["attention_mask"] = document_causal_mask(docs)
    elif attn_implementation == "eager":
        kwargs["attention_mask"] = additive_mask(document_causal_mask(docs), dtype)
    elif attn_implementation == "flex_attention":
        kwargs["attention_mask"] = document_block_mask(docs)
    elif attn_implementation in FLASH_IMPLEMENTATIONS:
        _require_flash_attn(attn_implementation)
        kwargs.update(flash_varlen_kwargs(batch.position_ids))
    else:
        raise ShardtuneError(f"packing: attn_implementation {attn_implementation!r} has no document mask here; "
                             "use sdpa, eager, flex_attention or flash_attention_2 (or data.packing=false)")
    return kwargs


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool, True where query q may attend key kv: same document and kv <= q."""
    seq = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> float mask added to the scores: 0 where True, finfo(dtype).min elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def document_block_mask(document_ids: torch.Tensor) -> Any:
    """A FlexAttention BlockMask for ``doc[b, q] == doc[b, kv] and kv <= q`` over ``[B, S]`` document ids.

    On CUDA ``create_block_mask`` runs compiled (once per shape: the mask_mod closes over
    ``document_ids``, which the compiled function takes as an ordinary tensor input), so no dense
    ``[B, S, S]`` mask is ever materialised; elsewhere it runs eagerly (dense, fine for small shapes).
    The decoder blocks, compiled or not, receive the BlockMask as an input: a new batch does not
    recompile them.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids
    batch, seq = docs.shape

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    build = _compiled_create_block_mask() if docs.device.type == "cuda" else create_block_mask
    return build(document_causal, batch, None, seq, seq, device=docs.device)


@functools.cache
def _compiled_create_block_mask() -> Any:
    # torch's recommended form (the `_compile=True` flag is deprecated in recent torch).
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """flash-attn varlen arguments for the ``[B, S]`` rows flattened to ``B * S`` tokens.

    A sequence starts wherever the position id is 0: at each example and at the padding run (which
    ``collate_packed`` numbers from 0 as well), so every row boundary is a start too. Transformers
    only infers this from ``position_ids`` itself when the batch has one row (``_is_packed_sequence``
    checks ``batch_size == 1``), hence the explicit ``cu_seq_lens``. ``max_length`` is the row length,
    an upper bound that flash-attn accepts; it avoids a device-to-host sync and keeps compiled shapes
    fixed.
    """
    seq = position_ids.shape[-1]
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.full((1,), flat.numel(), dtype=starts.dtype, device=flat.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": seq, "max_length_k": seq}


def _require_flash_attn(attn_implementation: str) -> None:
    import importlib.util

    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ShardtuneError("packing with attn_implementation=flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn) and a CUDA GPU; or use sdpa or flex_attention")
