"""The joined pipeline: sources -> cache -> split -> weights -> subset -> truncation -> packing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtune.config import DataConfig
from shardtune.data.pipeline import build_data
from shardtune.errors import ShardtuneError
from shardtune.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TASKS = str(ROOT / "examples" / "data" / "tasks.jsonl")
CHAT = str(ROOT / "examples" / "data" / "tasks_chat.jsonl")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    kw.setdefault("num_proc", 1)
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def _write(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_split_is_deterministic_disjoint_and_cached(tmp_path, tok):
    cfg = _cfg(tmp_path, train_file=TASKS, eval_fraction=0.05)
    a = build_data(cfg, tok, 24, seed=3)
    b = build_data(cfg, tok, 24, seed=3)
    assert not a.reports[0].cache_hit and b.reports[0].cache_hit  # tokenized once
    assert len(a.train) == 19_000 and len(a.eval) == 1_000
    train_rows = {tuple(a.train[i].input_ids) for i in range(len(a.train))}
    eval_rows = {tuple(a.eval[i].input_ids) for i in range(len(a.eval))}
    assert not train_rows & eval_rows  # prompts are unique, so the split really holds out
    assert [a.eval[i].input_ids for i in range(20)] == [b.eval[i].input_ids for i in range(20)]
    c = build_data(cfg, tok, 24, seed=4)
    assert [a.eval[i].input_ids for i in range(20)] != [c.eval[i].input_ids for i in range(20)]


def test_eval_file_and_prompt_masking(tmp_path, tok):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "ab=", "completion": "ba"}] * 6)
    evals = _write(tmp_path / "e.jsonl", [{"prompt": "cd=", "completion": "dc"}] * 2)
    data = build_data(_cfg(tmp_path, train_file=train, eval_file=evals), tok, 16, seed=0)
    assert len(data.train) == 6 and len(data.eval) == 2
    ex = data.eval[0]
    loss = [tid for tid, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != -100]
    assert tok.decode(loss) == "dc</s>"


def test_weights_mix_sources_per_epoch(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    b = _write(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(10)])
    cfg = _cfg(tmp_path, sources=[{"path": a, "weight": 2.0}, {"path": b, "weight": 0.5}], eval_fraction=0.0)
    data = build_data(cfg, tok, 16, seed=0)
    texts = [tok.decode(data.train[i].input_ids, skip_special_tokens=True) for i in range(len(data.train))]
    assert sum(t.startswith("a") for t in texts) == 20 and sum(t.startswith("b") for t in texts) == 5
    assert len({t for t in texts if t.startswith("b")}) == 5


def test_subset_fraction_and_max_examples(tmp_path, tok):
    full = build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.0), tok, 24, seed=0)
    frac = build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.0, fraction=0.1), tok, 24, seed=0)
    capped = build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.0, fraction=0.1, max_examples=50),
                        tok, 24, seed=0)
    assert len(full.train) == 20_000 and len(frac.train) == 2_000 and len(capped.train) == 50
    again = build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.0, max_examples=50), tok, 24, seed=0)
    assert [again.train[i].input_ids for i in range(50)] == [
        build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.0, max_examples=50), tok, 24, seed=0)
        .train[i].input_ids for i in range(50)]


def test_truncate_or_drop_long_examples_and_drop_no_loss(tmp_path, tok):
    rows = [{"prompt": "x" * 30, "completion": "y"},  # loss falls outside seq_len: dropped
            {"prompt": "p=", "completion": "z" * 30},  # long: truncated, or dropped
            {"prompt": "p=", "completion": "ok"}]
    path = _write(tmp_path / "d.jsonl", rows)
    cut = build_data(_cfg(tmp_path, train_file=path, eval_fraction=0.0), tok, 16, seed=0)
    r = cut.reports[0]
    # The first row is long too, but cut to seq_len it has no loss token left: dropped, not "truncated".
    assert (r.truncated, r.dropped_no_loss, r.dropped_too_long, len(cut.train)) == (1, 1, 0, 2)
    assert max(len(cut.train[i].input_ids) for i in range(2)) == 16
    drop = build_data(_cfg(tmp_path, train_file=path, eval_fraction=0.0, truncation="drop"), tok, 16, seed=0)
    assert (drop.reports[0].dropped_too_long, len(drop.train)) == (2, 1)


def test_bad_rows_skipped_counted_or_strict(tmp_path, tok):
    rows = [{"prompt": "a=", "completion": "b"}, '{"prompt": "a="', {"prompt": "a="},
            {"prompt": "a=", "completion": 5}, {"prompt": "a=", "completion": "c"}]
    path = _write(tmp_path / "bad.jsonl", rows)
    data = build_data(_cfg(tmp_path, train_file=path, eval_fraction=0.0), tok, 16, seed=0)
    bad = data.reports[0].bad_rows
    assert len(data.train) == 2 and sum(v["count"] for v in bad.values()) == 3
    assert {loc for v in bad.values() for loc in v["first"]} == {f"{path}:2", f"{path}:3", f"{path}:4"}
    with pytest.raises(ShardtuneError, match=r"bad\.jsonl:2: "):
        build_data(_cfg(tmp_path / "strict", train_file=path, eval_fraction=0.0, strict=True), tok, 16, seed=0)


def test_chat_source_with_packing(tmp_path, tok):
    data = build_data(_cfg(tmp_path, train_file=CHAT, packing=True, eval_fraction=0.02), tok, 160, seed=0)
    assert data.packed and data.reports[0].format == "messages" and "chatml" in data.reports[0].template
    assert data.stats["packing_efficiency"] > 0.9 > data.stats["padded_efficiency"]
    seen = sorted(i for b in data.train.bins for i in b)
    assert seen == list(range(len(data.train.examples)))  # every example packed exactly once
    batch = data.train_batch([0, 1])
    assert batch.input_ids.shape == (2, 160) and batch.position_ids is not None
    lengths = data.train.examples.lengths
    assert batch.num_tokens == int(sum(lengths[i] for i in data.train.bins[0] + data.train.bins[1]))


def test_no_usable_rows_is_a_clear_error(tmp_path, tok):
    path = _write(tmp_path / "none.jsonl", [{"foo": "bar"}])
    with pytest.raises(ShardtuneError, match="no row has the fields"):
        build_data(_cfg(tmp_path, train_file=path), tok, 16, seed=0)


def test_lengths_view_matches_items(tmp_path, tok):
    data = build_data(_cfg(tmp_path, train_file=TASKS, eval_fraction=0.01), tok, 24, seed=0)
    lengths = data.train.lengths
    assert np.array_equal(lengths[:50], [len(data.train[i].input_ids) for i in range(50)])
