"""Packing: best-fit-decreasing bins, efficiency, and the packed collate (positions, document ids, labels)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shardtune.data.batch import IGNORE_INDEX, Batch, Example, collate
from shardtune.data.packing import (
    collate_packed,
    pack_best_fit_decreasing,
    packing_efficiency,
    padded_efficiency,
)


def _check_bins(lengths, bins, capacity):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every index exactly once"
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


# ---------------------------------------------------------------- best-fit decreasing


def test_bfd_hand_example_picks_the_fullest_bin_that_fits():
    # Sorted: 6(0) 5(1) 4(2) 3(3) 2(4) 2(5). Capacity 10.
    #   6 -> new bin A (free 4); 5 -> new bin B (free 5); 4 -> A is the fullest that fits (free 4 -> 0);
    #   3 -> B (free 5 -> 2); 2 -> B (free 2 -> 0, the fullest, not a new bin); 2 -> new bin C.
    lengths = [6, 5, 4, 3, 2, 2]
    assert pack_best_fit_decreasing(lengths, 10) == [[0, 2], [1, 3, 4], [5]]
    # 7 -> bin 0 (free 3); 5 -> bin 1 (free 5); 4 -> bin 1 (free 1); the 1 fits both: best fit takes the
    # fuller bin 1, where first-fit decreasing would have taken bin 0 ([[0, 3], [1, 2]]).
    assert pack_best_fit_decreasing([7, 5, 4, 1], 10) == [[0], [1, 2, 3]]


def test_bfd_ties_by_index_and_lowest_bin_number():
    # Equal lengths keep index order; equal free space goes to the lower-numbered bin.
    assert pack_best_fit_decreasing([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert pack_best_fit_decreasing([4, 4, 4, 2, 2], 6) == [[0, 3], [1, 4], [2]]


def test_bfd_respects_capacity_and_places_every_index_once():
    rng = np.random.default_rng(0)
    for capacity in (1, 7, 64, 4096):
        lengths = rng.integers(1, capacity + 1, size=2000).tolist()
        bins = pack_best_fit_decreasing(lengths, capacity)
        _check_bins(lengths, bins, capacity)
        assert len(bins) >= -(-sum(lengths) // capacity)


def test_bfd_is_deterministic_and_accepts_numpy():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, size=5000)
    a = pack_best_fit_decreasing(lengths, 512)
    b = pack_best_fit_decreasing(lengths.tolist(), 512)
    assert a == b == pack_best_fit_decreasing(list(lengths), 512)


def test_bfd_rejects_too_long_and_empty_items():
    with pytest.raises(ValueError, match="example 1 has length 11 > capacity 10"):
        pack_best_fit_decreasing([3, 11, 2], 10)
    with pytest.raises(ValueError, match="length 0"):
        pack_best_fit_decreasing([3, 0], 10)
    assert pack_best_fit_decreasing([], 10) == []


def test_bfd_is_fast_and_efficient_on_200k_items():
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(5.5, 0.9, size=200_000).astype(np.int64), 1, 4096)
    # CPU time of this process, not wall time: a guard against quadratic behaviour (minutes at 200k items) that
    # other processes on a busy 2-core machine cannot trip.
    t0 = time.process_time()
    bins = pack_best_fit_decreasing(lengths, 4096)
    seconds = time.process_time() - t0
    assert seconds < 2.0, f"{seconds:.2f} CPU-s"
    _check_bins(lengths.tolist(), bins, 4096)
    packed = packing_efficiency(lengths, bins, 4096)
    padded = padded_efficiency(lengths, 4096)
    assert packed > 0.99  # many small items: BFD packs nearly perfectly
    assert padded < 0.1
    assert packed == pytest.approx(int(lengths.sum()) / (len(bins) * 4096))


def test_efficiency_numbers():
    lengths = [6, 5, 4, 3, 2, 2]
    bins = pack_best_fit_decreasing(lengths, 10)
    assert packing_efficiency(lengths, bins, 10) == pytest.approx(22 / 30)
    assert padded_efficiency(lengths, 10) == pytest.approx(22 / 60)
    assert packing_efficiency(lengths, [], 10) == 0.0
    assert padded_efficiency([], 10) == 0.0


# ---------------------------------------------------------------- collate_packed


def _ex(ids, labels=None):
    return Example(input_ids=list(ids), labels=list(ids) if labels is None else list(labels))


def test_collate_packed_positions_documents_labels():
    a = _ex([11, 12, 13], [-100, 12, 13])  # prompt token 11, completion 12 13
    b = _ex([21, 22], [21, 22])
    c = _ex([31, 32, 33, 34], [-100, -100, 33, 34])
    batch = collate_packed([[a, b], [c]], seq_len=8, pad_id=0)
    assert batch.is_packed
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 0, 0, 0], [31, 32, 33, 34, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    # positions restart per example; the padding run is numbered from 0 like one more document
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1], [0, 0, 0, 0, -1, -1, -1, -1]]
    # the first token of every example is never a target (b's 21 would be predicted from a's 13)
    assert batch.labels.tolist() == [[-100, 12, 13, -100, 22, -100, -100, -100],
                                     [-100, -100, 33, 34, -100, -100, -100, -100]]
    assert batch.num_target_tokens == sum(e.num_target_tokens for e in (a, b, c)) == 5
    assert batch.num_tokens == 9
    for t in (batch.input_ids, batch.labels, batch.position_ids, batch.document_ids, batch.attention_mask):
        assert t.dtype == torch.long and t.shape == (2, 8)


def test_collate_packed_full_row_fill_rows_and_errors():
    a, b = _ex([5, 6, 7]), _ex([8])
    batch = collate_packed([[a, b]], seq_len=4, pad_id=9, batch_size=3)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9] * 4, [9] * 4]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1], [-1] * 4, [-1] * 4]
    assert batch.labels.tolist() == [[-100, 6, 7, -100], [-100] * 4, [-100] * 4]
    assert batch.attention_mask[1:].sum() == 0
    with pytest.raises(ValueError, match="row 0"):
        collate_packed([[a, b, a]], seq_len=6, pad_id=0)
    with pytest.raises(ValueError, match="batch_size"):
        collate_packed([[a], [b]], seq_len=6, pad_id=0, batch_size=1)
    with pytest.raises(ValueError, match="labels"):
        collate_packed([[Example([1, 2], [1])]], seq_len=6, pad_id=0)


def test_collate_packed_one_example_per_row_matches_collate():
    exs = [_ex([3, 4, 5], [-100, 4, 5]), _ex([6, 7])]
    packed = collate_packed([[e] for e in exs], seq_len=5, pad_id=0)
    plain = collate(exs, seq_len=5, pad_id=0)
    for name in ("input_ids", "attention_mask"):
        assert torch.equal(getattr(packed, name), getattr(plain, name)), name
    # label 0 is never scored (nothing precedes it); packed rows set it to -100, the rest is the same
    assert torch.equal(packed.labels[:, 1:], plain.labels[:, 1:])
    assert packed.num_target_tokens == plain.num_target_tokens
    assert plain.position_ids is None and plain.document_ids is None and not plain.is_packed


def test_batch_to_carries_the_packed_fields():
    batch = collate_packed([[_ex([1, 2]), _ex([3])]], seq_len=4, pad_id=0)
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and moved is not batch
    assert torch.equal(moved.position_ids, batch.position_ids)
    assert torch.equal(moved.document_ids, batch.document_ids)
    plain = collate([_ex([1, 2])], seq_len=4, pad_id=0).to(torch.device("cpu"))
    assert plain.position_ids is None and plain.document_ids is None
    assert IGNORE_INDEX == -100
