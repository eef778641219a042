"""The data pipeline: sources -> rendered tokens + loss mask (cached on disk) -> held-out split ->
mixing weights -> subset -> truncation -> optional packing -> batches.

Each source is tokenized once per (content, tokenizer, formatting) into a memory-mapped TokenStore
(local rank 0 of each node builds it, the other ranks and later runs reuse it). Everything after
the cache is cheap index arithmetic, so changing seq_len, weights, subset or packing never
re-tokenizes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardtune.config import DataConfig, SourceConfig
from shardtune.data.batch import IGNORE_INDEX, Batch, Example, collate
from shardtune.data.cache import TokenStore, cache_key, cached_store, default_cache_root
from shardtune.data.formats import RenderSpec, RowEncoder, detect_format, tokenizer_fingerprint
from shardtune.data.packing import collate_packed, pack_best_fit_decreasing, packing_efficiency, padded_efficiency
from shardtune.data.sources import iter_rows, source_fingerprint
from shardtune.data.templates import resolve_chat_template
from shardtune.errors import ShardtuneError


@dataclass
class SourceReport:
    """What happened to one source on its way to training examples (for validate and the run log)."""

    path: str
    format: str
    template: str | None
    weight: float
    cache_hit: bool
    rows_read: int
    bad_rows: dict[str, Any]
    examples: int
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_loss: int = 0
    train_examples: int = 0
    eval_examples: int = 0


def skipped_line(reports: list[SourceReport]) -> str | None:
    """One line for the run log: the bad rows skipped (count per reason) and the examples dropped, per source;
    None when nothing was. `shardtune validate` prints the same counts with the first rows of each reason."""
    parts = []
    for r in reports:
        if r.bad_rows:
            total = sum(v["count"] for v in r.bad_rows.values())
            reasons = ", ".join(f"{v['count']:,} {reason}" for reason, v in r.bad_rows.items())
            parts.append(f"{total:,} bad row{'s' if total != 1 else ''} in {r.path} ({reasons})")
        if r.dropped_no_loss:
            parts.append(f"{r.dropped_no_loss:,} examples of {r.path} with no loss token within seq_len")
        if r.dropped_too_long:
            parts.append(f"{r.dropped_too_long:,} examples of {r.path} longer than seq_len (data.truncation: drop)")
    if not parts:
        return None
    return f"data: skipped {'; '.join(parts)}; `shardtune validate` names the first rows of each"


@dataclass
class _Part:
    """A source's usable examples: the store and the (index, length) of each one within seq_len."""

    store: TokenStore
    index: np.ndarray  # example indices in the store
    length: np.ndarray  # tokens used of each (after truncation)


class ExampleView:
    """A list-like of Examples drawn from several stores, each cut to its length (no copies until read)."""

    def __init__(self, parts: Sequence[_Part], part_of: np.ndarray, row_of: np.ndarray) -> None:
        self.parts, self.part_of, self.row_of = parts, part_of, row_of

    def __len__(self) -> int:
        return len(self.part_of)

    @property
    def lengths(self) -> np.ndarray:
        out = np.empty(len(self.part_of), dtype=np.int64)
        for p, part in enumerate(self.parts):
            mine = self.part_of == p
            out[mine] = part.length[self.row_of[mine]]
        return out

    def __getitem__(self, i: int) -> Example:
        part = self.parts[int(self.part_of[i])]
        r = int(self.row_of[i])
        ids, trainable = part.store.example(int(part.index[r]))
        n = int(part.length[r])
        ids = np.asarray(ids[:n], dtype=np.int64)
        labels = np.where(np.asarray(trainable[:n], dtype=bool), ids, IGNORE_INDEX)
        return Example(ids.tolist(), labels.tolist())


@dataclass
class DataBundle:
    """Training and eval data ready for the loop."""

    train: Any  # ExampleView, or PackedView when packing
    eval: ExampleView
    seq_len: int
    pad_id: int
    packed: bool
    reports: list[SourceReport] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def train_batch(self, indices: Sequence[int]) -> Batch:
        items = [self.train[i] for i in indices]
        if self.packed:
            return collate_packed(items, self.seq_len, self.pad_id)
        return collate(items, self.seq_len, self.pad_id)

    def eval_batch(self, indices: Sequence[int], batch_size: int) -> Batch:
        """Unpacked, padded to `batch_size` rows so every rank and step has one shape."""
        return collate([self.eval[i] for i in indices], self.seq_len, self.pad_id, batch_size=batch_size)


class PackedView:
    """Rows of several examples each (best-fit-decreasing bins); item i is a list of Examples."""

    def __init__(self, examples: ExampleView, bins: list[list[int]]) -> None:
        self.examples, self.bins = examples, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> list[Example]:
        return [self.examples[j] for j in self.bins[i]]


# ---- per source ------------------------------------------------------------------------------------

def _first_good_row(source: SourceConfig) -> dict[str, Any]:
    rows, not_utf8 = 0, None
    for item in iter_rows(source.path, source.split):
        rows += 1
        if item.row is not None and detect_format(item.row, source) is not None:
            return item.row
        if item.row is None and item.error and "UTF-8" in item.error:
            not_utf8 = not_utf8 or item.where
    if rows == 0:
        raise ShardtuneError(f"data source {source.path!r} is empty (no rows); point data at a file with examples")
    if not_utf8 is not None:
        raise ShardtuneError(f"data source {source.path!r} is not UTF-8 text (first at {not_utf8}); convert it, "
                             f"e.g. iconv -f latin1 -t utf-8")
    raise ShardtuneError(f"data source {source.path!r}: no row has the fields of any format "
                         f"(text, prompt+completion, messages, instruction+output); map columns with `fields`")


def render_spec(source: SourceConfig, cfg: DataConfig, tokenizer: Any) -> tuple[RenderSpec, str | None]:
    """How this source's rows become tokens, and the chat template's label (for messages)."""
    fmt = source.format
    if fmt == "auto":
        fmt = detect_format(_first_good_row(source), source)
    template, label = (None, None)
    if fmt == "messages":
        template, label = resolve_chat_template(cfg.chat_template, tokenizer)
    columns = {name: source.column(name) for name in ("text", "prompt", "completion", "messages",
                                                      "instruction", "input", "output")}
    return RenderSpec(format=fmt, columns=columns, chat_template=template, train_on=cfg.train_on,
                      add_eos=cfg.add_eos), label


def tokenize_source(source: SourceConfig, cfg: DataConfig, tokenizer: Any, *,
                    builder: bool) -> tuple[TokenStore, RenderSpec, str | None, bool]:
    """The source's TokenStore, from the cache or built now (by `builder`; the others wait)."""
    spec, label = render_spec(source, cfg, tokenizer)
    # The key holds every setting that changes what the store holds: the source's bytes (and split), the
    # tokenizer (vocabulary, special tokens, its chat template), the render spec (format, fields -> columns,
    # chat_template, train_on, add_eos, the encoder's version) and strict (a lenient build skips bad rows that a
    # strict run must stop at). Settings applied to a store after it is read are left out, so changing them never
    # re-tokenizes: train.seq_len, truncation, packing, weight, max_examples, fraction, eval_fraction, seed.
    # num_proc and cache_dir change where and how fast, not what.
    key = cache_key(source_fingerprint(source.path, source.split), tokenizer_fingerprint(tokenizer),
                    spec.fingerprint(), f"strict={cfg.strict}")
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_root()
    store, hit = cached_store(key, root, lambda: iter_rows(source.path, source.split),
                              RowEncoder(tokenizer, spec), num_proc=_num_proc(cfg), strict=cfg.strict,
                              rank_is_builder=builder)
    return store, spec, label, hit


def _num_proc(cfg: DataConfig) -> int:
    if cfg.num_proc != "auto":
        return int(cfg.num_proc)
    return max(1, min(8, (os.cpu_count() or 1) - 1))


def usable_examples(store: TokenStore, seq_len: int, truncation: str) -> tuple[_Part, dict[str, int]]:
    """Examples that fit (or are cut to) seq_len and keep at least one loss token."""
    lengths = np.asarray(store.lengths, dtype=np.int64)
    long = lengths > seq_len
    keep = ~long if truncation == "drop" else np.ones(len(lengths), dtype=bool)
    used = np.minimum(lengths, seq_len)
    loss = store.trainable_counts(used)  # loss tokens within the first `used` (position 0 never counts)
    no_loss = keep & (loss == 0)
    keep &= loss > 0
    index = np.flatnonzero(keep)
    counts = {"truncated": int((long & keep).sum()) if truncation == "truncate" else 0,
              "dropped_too_long": int(long.sum()) if truncation == "drop" else 0,
              "dropped_no_loss": int(no_loss.sum())}
    return _Part(store, index, used[index]), counts


# ---- the whole data set ----------------------------------------------------------------------------

def _split(n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) positions; at least one eval example when fraction > 0 and n >= 2."""
    n_eval = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * fraction)))
    order = rng.permutation(n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def _weighted(rows: np.ndarray, weight: float, rng: np.random.Generator) -> np.ndarray:
    """Repeat rows floor(weight) times, plus a seeded share for the fraction: examples per epoch."""
    whole, frac = math.floor(weight), weight - math.floor(weight)
    extra = rng.choice(rows, size=round(frac * len(rows)), replace=False) if frac > 0 and len(rows) else rows[:0]
    return np.concatenate([np.tile(rows, whole), np.sort(extra)])


def _subset(n: int, cfg: DataConfig, rng: np.random.Generator) -> np.ndarray:
    keep = n if cfg.fraction >= 1.0 else max(1, int(n * cfg.fraction))
    if cfg.max_examples is not None:
        keep = min(keep, cfg.max_examples)
    if keep >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=keep, replace=False))


def build_data(cfg: DataConfig, tokenizer: Any, seq_len: int, seed: int, *, builder: bool = True) -> DataBundle:
    """Everything the loop needs; `builder` = this process may tokenize (local rank 0)."""
    rng = np.random.default_rng(seed)
    parts: list[_Part] = []
    reports: list[SourceReport] = []
    train_part, train_row, eval_part, eval_row = [], [], [], []
    for source in cfg.all_sources():
        store, spec, label, hit = tokenize_source(source, cfg, tokenizer, builder=builder)
        part, counts = usable_examples(store, seq_len, cfg.truncation)
        held_out = cfg.eval_fraction if cfg.eval_file is None else 0.0
        tr, ev = _split(len(part.index), held_out, rng)
        tr = _weighted(tr, source.weight, rng)
        p = len(parts)
        parts.append(part)
        train_part.append(np.full(len(tr), p)), train_row.append(tr)
        eval_part.append(np.full(len(ev), p)), eval_row.append(ev)
        reports.append(SourceReport(path=source.path, format=spec.format, template=label, weight=source.weight,
                                    cache_hit=hit, rows_read=int(store.meta.get("num_rows_read", len(store))),
                                    bad_rows=store.meta.get("bad_rows", {}), examples=len(store),
                                    train_examples=len(tr), eval_examples=len(ev), **counts))
    if cfg.eval_file is not None:
        source = SourceConfig(path=cfg.eval_file, format=cfg.format, fields=cfg.fields)
        store, spec, label, hit = tokenize_source(source, cfg, tokenizer, builder=builder)
        part, counts = usable_examples(store, seq_len, cfg.truncation)
        p = len(parts)
        parts.append(part)
        eval_part.append(np.full(len(part.index), p)), eval_row.append(np.arange(len(part.index)))
        reports.append(SourceReport(path=source.path, format=spec.format, template=label, weight=0.0,
                                    cache_hit=hit, rows_read=int(store.meta.get("num_rows_read", len(store))),
                                    bad_rows=store.meta.get("bad_rows", {}), examples=len(store),
                                    eval_examples=len(part.index), **counts))
    tp, tr = np.concatenate(train_part), np.concatenate(train_row)
    if len(tp) == 0:
        raise ShardtuneError(f"no training example has a loss token within train.seq_len={seq_len} "
                             "(see `shardtune validate` for the per-source counts)")
    pick = _subset(len(tp), cfg, rng)
    train = ExampleView(parts, tp[pick], tr[pick])
    evals = ExampleView(parts, np.concatenate(eval_part), np.concatenate(eval_row))
    pad_id = tokenizer.pad_token_id
    bundle = DataBundle(train=train, eval=evals, seq_len=seq_len, pad_id=pad_id, packed=cfg.packing,
                        reports=reports)
    lengths = train.lengths
    bundle.stats = {"train_examples": len(train), "eval_examples": len(evals),
                    "padded_efficiency": padded_efficiency(lengths, seq_len),
                    "length_percentiles": _percentiles(lengths)}
    if cfg.packing:
        bins = pack_best_fit_decreasing(lengths, seq_len)
        bundle.train = PackedView(train, bins)
        bundle.stats.update(packed_rows=len(bins), packing_efficiency=packing_efficiency(lengths, bins, seq_len))
    return bundle


def _percentiles(lengths: np.ndarray) -> dict[str, int]:
    if len(lengths) == 0:
        return {}
    p = np.percentile(lengths, [50, 90, 99])
    return {"p50": int(p[0]), "p90": int(p[1]), "p99": int(p[2]), "max": int(lengths.max())}
