"""Fixed-shape batches: right padding to exactly seq_len, unshifted labels with -100 where there is no loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index, also what transformers uses


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized example: ``input_ids`` and same-length ``labels`` (unshifted, -100 = no loss)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry loss: position 0 is never a target because nothing precedes it."""
        return sum(1 for x in self.labels[1:] if x != IGNORE_INDEX)


@dataclass
class Batch:
    """A micro-batch of ``[B, S]`` ``torch.long`` tensors.

    ``labels`` follow the Hugging Face convention: not shifted, the model's logits at position t are
    scored against ``labels[:, t + 1]``; -100 marks prompt tokens and padding.

    Packed batches (``collate_packed`` in data/packing.py) also carry ``position_ids`` (restarting at 0
    for every example) and ``document_ids`` (0, 1, ... per example within a row, -1 on padding); the
    model call then gets a document-causal attention mask built from them (models/attention.py).
    Unpacked batches leave both None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    # input_ids as they were on the host, kept by to_device: a lookup on the host (peft.offload_embedding) reads
    # them without waiting for the GPU
    host_input_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory (needs CUDA)."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        return Batch(input_ids=fn(self.input_ids), attention_mask=fn(self.attention_mask), labels=fn(self.labels),
                     position_ids=None if self.position_ids is None else fn(self.position_ids),
                     document_ids=None if self.document_ids is None else fn(self.document_ids))

    @property
    def is_packed(self) -> bool:
        """Whether rows hold several examples (``document_ids`` set): attention must stay within each."""
        return self.document_ids is not None

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry loss after the shift: ``(labels[:, 1:] != -100).sum()``."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens: ``attention_mask.sum()``."""
        return int(self.attention_mask.sum())


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device` without making the host wait. From pageable memory a host-to-GPU copy may first wait
    for every kernel queued on the stream (CUDA's API sync behaviour: the driver stages it through pinned memory),
    so the GPU's queue would drain at each micro-batch; from pinned memory it is queued behind them and the host
    goes on (torch's pinned allocator keeps the block until the copy has run)."""
    if device.type != "cuda":
        return dataclasses.replace(batch.to(device), host_input_ids=batch.input_ids)
    pinned = batch.pin_memory()
    return dataclasses.replace(pinned.to(device, non_blocking=True), host_input_ids=pinned.input_ids)


def blank_rows(n: int, seq_len: int, pad_id: int,
               batch_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-padding (input_ids, attention_mask, labels) for n rows, or batch_size rows when given."""
    rows = n if batch_size is None else batch_size
    if rows < n:
        raise ValueError(f"batch_size={batch_size} is smaller than the {n} rows given")
    return (torch.full((rows, seq_len), pad_id, dtype=torch.long), torch.zeros((rows, seq_len), dtype=torch.long),
            torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long))


def collate(examples: Sequence[Example], seq_len: int, pad_id: int, batch_size: int | None = None) -> Batch:
    """Stack examples into a Batch right-padded to exactly ``seq_len`` (fixed shapes avoid recompiles).

    Padding has ``attention_mask`` 0, ``input_ids`` ``pad_id`` and labels -100. With ``batch_size`` the
    batch is filled up to that many rows with all-padding rows (no tokens, no loss), so a rank that ran
    out of eval examples can still join the same collective forward pass with the same shapes.
    """
    input_ids, attention_mask, labels = blank_rows(len(examples), seq_len, pad_id, batch_size)
    for i, ex in enumerate(examples):
        n = len(ex.input_ids)
        if n > seq_len or len(ex.labels) != n:
            raise ValueError(f"example {i}: {n} input ids and {len(ex.labels)} labels; need equal and <= {seq_len}")
        input_ids[i, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(ex.labels, dtype=torch.long)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
