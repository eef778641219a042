"""Packing: several examples per fixed-length row, with nothing leaking between them.

``pack_best_fit_decreasing`` assigns examples to rows (bins); ``collate_packed`` turns rows of examples
into a ``Batch`` that carries per-example ``position_ids`` and ``document_ids``. The attention mask that
keeps each example to itself is built from ``document_ids`` by ``shardtune.models.attention.model_inputs``
(naive packing, where examples attend to each other, is the bug of trl issues #805/#1230/#3067).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from heapq import heappop, heappush

import numpy as np
import torch

from shardtune.data.batch import IGNORE_INDEX, Batch, Example, blank_rows

PAD_DOCUMENT = -1  # document id of padding tokens


def _lengths_array(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size:
        if int(arr.min()) < 1:
            i = int(np.argmin(arr))
            raise ValueError(f"example {i} has length {int(arr[i])}; packing needs lengths >= 1 (drop empty examples)")
        if int(arr.max()) > capacity:
            i = int(np.argmax(arr))
            raise ValueError(f"example {i} has length {int(arr[i])} > capacity {capacity}; truncate or drop it first")
    return arr


def pack_best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of example indices, each with total length <= ``capacity``, by best-fit decreasing.

    Items are taken longest first (ties in index order) and each goes into the fullest open bin it fits
    in (the one with the least free space >= its length; among bins with equal free space, the lowest
    bin number); a new bin is opened when none fits. Bins are numbered and returned in creation order;
    within a bin, indices are in the order they were placed (non-increasing length). Deterministic.

    Open bins are kept in buckets by free space (a heap of bin numbers per free-space value) with a
    sorted list of the free-space values in use, so each item costs one bisect: O(N log N) for the
    sort plus O(N log capacity) for the placement. Bins whose free space is smaller than the shortest
    item are closed. Raises ValueError for lengths < 1 or > capacity.
    """
    arr = _lengths_array(lengths, capacity)
    if arr.size == 0:
        return []
    order = np.argsort(-arr, kind="stable").tolist()  # longest first, ties by index
    sorted_lengths = arr[order].tolist()
    smallest = sorted_lengths[-1]
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # free space -> heap of bin numbers with exactly that free space
    spaces: list[int] = []  # sorted free-space values that have a non-empty bucket
    for idx, length in zip(order, sorted_lengths, strict=True):
        pos = bisect_left(spaces, length)
        if pos == len(spaces):
            b = len(bins)
            bins.append([idx])
            free = capacity - length
        else:
            space = spaces[pos]
            heap = buckets[space]
            b = heappop(heap)
            if not heap:
                del buckets[space]
                del spaces[pos]
            bins[b].append(idx)
            free = space - length
        if free >= smallest:  # otherwise nothing left can ever fit: the bin is closed
            heap = buckets.get(free)
            if heap is None:
                buckets[free] = [b]
                insort(spaces, free)
            else:
                heappush(heap, b)
    return bins


def packing_efficiency(lengths: Sequence[int] | np.ndarray, bins: Sequence[Sequence[int]], capacity: int) -> float:
    """Share of the packed rows' tokens that are not padding: sum of packed lengths / (rows * capacity)."""
    if not bins:
        return 0.0
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    used = sum(int(arr[list(b)].sum()) for b in bins if len(b))
    return used / (len(bins) * capacity)


def padded_efficiency(lengths: Sequence[int] | np.ndarray, capacity: int) -> float:
    """The same for one example per row right-padded to ``capacity``: sum(lengths) / (n * capacity)."""
    arr = _lengths_array(lengths, capacity)
    if arr.size == 0:
        return 0.0
    return int(arr.sum()) / (arr.size * capacity)


def collate_packed(rows: Sequence[Sequence[Example]], seq_len: int, pad_id: int,
                   batch_size: int | None = None) -> Batch:
    """A Batch of packed rows: each row's examples concatenated left to right, then right-padded to ``seq_len``.

    Per row:
      input_ids       the examples' tokens, then ``pad_id``.
      attention_mask  1 on real tokens, 0 on padding.
      labels          each example's own labels, except that the FIRST token of every example is -100:
                      it is scored against the logits of the token before it, which belongs to the
                      previous example. Padding is -100. So a packed row carries exactly the loss of
                      its examples run one by one (``Example.num_target_tokens`` adds up).
      position_ids    restart at 0 at every example. The padding run is numbered 0, 1, 2, ... as if it
                      were one more document: every position stays < ``seq_len`` (as in an unpacked
                      batch, so RoPE and learned position tables see nothing new), and position-id based
                      sequence detection (flash-attention varlen, transformers' packed-sequence mask)
                      treats padding as a separate sequence rather than an extension of the last example.
      document_ids    0, 1, 2, ... per example within the row; -1 on padding.

    With ``batch_size`` the batch is filled up with all-padding rows (as ``collate`` does).
    """
    input_ids, attention_mask, labels = blank_rows(len(rows), seq_len, pad_id, batch_size)
    n_rows = input_ids.shape[0]
    position_ids = torch.arange(seq_len, dtype=torch.long).repeat(n_rows, 1)
    document_ids = torch.full((n_rows, seq_len), PAD_DOCUMENT, dtype=torch.long)
    for r, row in enumerate(rows):
        ids: list[int] = []
        labs: list[int] = []
        pos: list[int] = []
        docs: list[int] = []
        for d, ex in enumerate(row):
            n = len(ex.input_ids)
            if n == 0 or len(ex.labels) != n:
                raise ValueError(f"row {r}, example {d}: {n} input ids and {len(ex.labels)} labels; "
                                 "need equal and >= 1")
            ids.extend(ex.input_ids)
            labs.append(IGNORE_INDEX)
            labs.extend(ex.labels[1:])
            pos.extend(range(n))
            docs.extend([d] * n)
        n = len(ids)
        if n > seq_len:
            raise ValueError(f"row {r}: its {len(row)} examples have {n} tokens > seq_len {seq_len}")
        if n == 0:
            continue
        input_ids[r, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, :n] = 1
        labels[r, :n] = torch.tensor(labs, dtype=torch.long)
        position_ids[r, :n] = torch.tensor(pos, dtype=torch.long)
        position_ids[r, n:] = torch.arange(seq_len - n, dtype=torch.long)
        document_ids[r, :n] = torch.tensor(docs, dtype=torch.long)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 position_ids=position_ids, document_ids=document_ids)
