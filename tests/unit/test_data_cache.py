"""Tokenized data on disk: TokenStore, the streaming (parallel) builder, and the shared cache with its lock.

The encoders here are small stand-ins for the real RowEncoder: words -> ids, loss on the second half.
Encoders and process targets live at module level so worker processes can unpickle them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from shardtune.data import cache
from shardtune.data.cache import (
    HEADER_BYTES,
    build_store,
    cache_key,
    cached_store,
    default_cache_root,
    is_complete,
)
from shardtune.data.types import BadRow, RowItem
from shardtune.errors import ShardtuneError


class WordEncoder:
    """text -> [1] + one id per word; the second half (and the last token) carries loss."""

    def __call__(self, row):
        if "text" not in row:
            raise BadRow("missing field 'text'")
        words = row["text"].split()
        if "BAD" in words:
            raise BadRow("marked bad")
        if "CRASH" in words:
            raise KeyError("a bug in the encoder")
        ids = [1] + [4 + zlib.crc32(w.encode()) % 5000 for w in words]
        half = len(ids) // 2
        return ids, [False] * half + [True] * (len(ids) - half)


class SlowEncoder(WordEncoder):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, row):
        time.sleep(self.delay)
        return super().__call__(row)


class MustNotRun:
    def __call__(self, row):
        raise AssertionError("the encoder ran on a cache hit")


def text_of(i: int) -> str:
    return " ".join(f"w{(i * 7 + k) % 97}" for k in range(1 + i % 13))


def make_rows(n: int, bad_every: int = 0, unreadable_every: int = 0, path: str = "data.jsonl"):
    for i in range(n):
        where = f"{path}:{i + 1}"
        if unreadable_every and i % unreadable_every == unreadable_every - 1:
            yield RowItem(where, None, "invalid JSON")
        elif bad_every and i % bad_every == bad_every - 1:
            yield RowItem(where, {"text": text_of(i) + " BAD"})
        else:
            yield RowItem(where, {"text": text_of(i)})


def expected(rows):
    enc = WordEncoder()
    out = []
    for item in rows:
        if item.row is None:
            continue
        try:
            out.append(enc(item.row))
        except BadRow:
            continue
    return out


# ---------------------------------------------------------------- TokenStore and build_store


def test_round_trip_offsets_lengths_and_meta(tmp_path):
    rows = list(make_rows(300, bad_every=10, unreadable_every=45))
    store = build_store(iter(rows), WordEncoder(), tmp_path / "s", num_proc=1, strict=False, chunk_size=64)
    want = expected(rows)
    assert len(store) == len(want)
    for i, (ids, trainable) in enumerate(want):
        got_ids, got_train = store.example(i)
        assert got_ids.dtype == np.uint32 and got_train.dtype == np.bool_
        assert got_ids.tolist() == ids and got_train.tolist() == trainable
    assert store[-1][0].tolist() == want[-1][0]
    with pytest.raises(IndexError):
        store.example(len(store))
    lengths = np.array([len(x) for x, _ in want])
    assert store.lengths.dtype == np.int64 and store.lengths.tolist() == lengths.tolist()
    offsets = np.load(tmp_path / "s" / "offsets.npy")  # plain .npy files, readable without shardtune
    assert offsets.dtype == np.int64 and offsets[0] == 0 and np.diff(offsets).tolist() == lengths.tolist()
    assert len(np.load(tmp_path / "s" / "input_ids.npy")) == offsets[-1] == store.num_tokens
    assert isinstance(store.input_ids, np.memmap)
    meta = store.meta
    assert meta["version"] == cache.FORMAT_VERSION
    assert meta["num_rows_read"] == 300 and meta["num_examples"] == len(want)
    assert meta["num_tokens"] == lengths.sum()
    assert meta["num_trainable_tokens"] == sum(sum(t) for _, t in want)
    p = meta["length_percentiles"]
    assert p["max"] == lengths.max() and p["p50"] == int(np.percentile(lengths, 50)) and p["p90"] <= p["p99"]
    assert set(meta) >= {"created", "num_bad_rows", "bad_rows", "extra"}
    # loss tokens within a limit, skipping position 0, in bounded blocks
    limit = np.full(len(store), 5)
    brute = [int(np.count_nonzero(t[1:5])) for _, t in want]
    assert store.trainable_counts(limit, block_tokens=37).tolist() == brute
    assert store.trainable_counts(skip_first=False).tolist() == [sum(t) for _, t in want]
    # pickles as its path (DataLoader workers must not copy the data)
    blob = pickle.dumps(store)
    assert len(blob) < 500 and pickle.loads(blob).example(3)[0].tolist() == want[3][0]


def test_bad_rows_counted_with_first_locations(tmp_path):
    rows = [*make_rows(100, bad_every=7, unreadable_every=30), RowItem("x.jsonl:101", {"other": 1})]
    store = build_store(iter(rows), WordEncoder(), tmp_path / "s", num_proc=1, strict=False, chunk_size=16)
    bad = store.meta["bad_rows"]
    assert bad["marked bad"]["count"] == 14  # lines 7, 14, ..., 98
    assert bad["marked bad"]["first"] == ["data.jsonl:7", "data.jsonl:14", "data.jsonl:21", "data.jsonl:28",
                                          "data.jsonl:35"]
    assert bad["invalid JSON"] == {"count": 3, "first": ["data.jsonl:30", "data.jsonl:60", "data.jsonl:90"]}
    assert bad["missing field 'text'"] == {"count": 1, "first": ["x.jsonl:101"]}
    assert store.meta["num_bad_rows"] == 18 and len(store) == 101 - 18


def test_strict_raises_at_the_first_bad_row_and_leaves_nothing(tmp_path):
    with pytest.raises(ShardtuneError, match=r"^data\.jsonl:5: marked bad$"):
        build_store(make_rows(50, bad_every=5), WordEncoder(), tmp_path / "s", num_proc=1, strict=True,
                    chunk_size=16)
    with pytest.raises(ShardtuneError, match=r"^data\.jsonl:4: invalid JSON$"):
        build_store(make_rows(50, bad_every=5, unreadable_every=4), WordEncoder(), tmp_path / "s", num_proc=1,
                    strict=True)
    assert list(tmp_path.iterdir()) == []  # no store, no temp directory


def test_empty_and_all_bad_and_small_data_stays_in_process(tmp_path):
    store = build_store(iter(()), WordEncoder(), tmp_path / "e", num_proc=2, strict=False)
    assert len(store) == 0 and store.lengths.tolist() == [] and store.meta["num_rows_read"] == 0
    store = build_store(make_rows(500), WordEncoder(), tmp_path / "small", num_proc=2, strict=False, chunk_size=10)
    assert len(store) == 500 and store.meta["num_proc"] == 1  # done before SERIAL_WARMUP_S: no workers
    store = build_store(make_rows(10, bad_every=1), WordEncoder(), tmp_path / "b", num_proc=1, strict=False)
    assert len(store) == 0 and store.meta["bad_rows"]["marked bad"]["count"] == 10


def test_npy_headers_are_fixed_size():
    # the builder reserves HEADER_BYTES before the data and writes the real header last
    import io

    for n in (0, 7, 2**62):
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": "<u4", "fortran_order": False, "shape": (n,)})
        assert len(buf.getvalue()) == HEADER_BYTES


def test_rows_are_read_lazily(tmp_path):
    """200k rows stream through: the first chunk is on disk long before the generator is exhausted."""
    consumed = 0
    seen_at_first_write: list[tuple[int, int]] = []

    def rows():
        nonlocal consumed
        for i in range(200_000):
            consumed += 1
            yield RowItem(f"big.jsonl:{i + 1}", {"text": "a b c d e f"})

    def progress(rows_read, examples):
        if not seen_at_first_write:
            tmp = next(tmp_path.glob(".s.tmp-*"))
            seen_at_first_write.append((consumed, (tmp / "input_ids.npy").stat().st_size))

    store = build_store(rows(), WordEncoder(), tmp_path / "s", num_proc=1, strict=False, chunk_size=1024,
                        progress=progress)
    assert consumed == 200_000 and len(store) == 200_000 and store.num_tokens == 1_400_000
    first_consumed, size = seen_at_first_write[0]
    assert first_consumed <= 2 * 1024  # one chunk read ahead at most (in-process)
    assert size >= HEADER_BYTES + 1024 * 7 * 4  # ... and already written to the file


def test_parallel_build_identical_to_serial_and_reads_ahead_boundedly(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "SERIAL_WARMUP_S", 0.0)  # workers from the first chunk (else: after 2 s)
    rows = list(make_rows(3000, bad_every=11, unreadable_every=97))
    consumed = 0
    first_write_at: list[int] = []

    def gen():
        nonlocal consumed
        for r in rows:
            consumed += 1
            yield r

    def progress(rows_read, examples):
        if not first_write_at:
            first_write_at.append(consumed)

    one = build_store(iter(rows), WordEncoder(), tmp_path / "one", num_proc=1, strict=False, chunk_size=100)
    two = build_store(gen(), WordEncoder(), tmp_path / "two", num_proc=2, strict=False, chunk_size=100,
                      progress=progress)
    for name in ("input_ids.npy", "trainable.npy", "offsets.npy"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert (one.meta["num_proc"], two.meta["num_proc"]) == (1, 2)
    volatile = {"created", "build_seconds", "num_proc"}
    assert ({k: v for k, v in one.meta.items() if k not in volatile} ==
            {k: v for k, v in two.meta.items() if k not in volatile})
    assert first_write_at[0] <= (2 * 2 + 1) * 100  # at most 2 * num_proc chunks in flight
    # strict and encoder bugs surface from the workers too
    with pytest.raises(ShardtuneError, match=r"^data\.jsonl:11: marked bad$"):
        build_store(iter(rows), WordEncoder(), tmp_path / "strict", num_proc=2, strict=True, chunk_size=100)
    crash = [*rows[:1500], RowItem("data.jsonl:1501", {"text": "CRASH"}), *rows[1500:]]
    with pytest.raises(RuntimeError, match=r"data\.jsonl:1501: the encoder failed \(KeyError"):
        build_store(iter(crash), WordEncoder(), tmp_path / "crash", num_proc=2, strict=False, chunk_size=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


# ---------------------------------------------------------------- the cache


def test_cache_key_and_default_root(monkeypatch, tmp_path):
    k = cache_key("data.jsonl@123", "tok:abc", "spec")
    assert k == cache_key("data.jsonl@123", "tok:abc", "spec") and len(k) == 24 and int(k, 16) >= 0
    assert k != cache_key("data.jsonl@124", "tok:abc", "spec")
    assert cache_key("ab", "c") != cache_key("a", "bc")
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    monkeypatch.delenv("SHARDTUNE_CACHE")
    assert default_cache_root() == Path.home() / ".cache" / "shardtune" / "data"


def test_hit_on_second_call_miss_on_other_key(tmp_path):
    calls = []

    def rows():
        calls.append(1)
        return make_rows(200, bad_every=9)

    store, hit = cached_store("k1", tmp_path, rows, WordEncoder(), num_proc=1, strict=False, rank_is_builder=True)
    assert not hit and len(calls) == 1 and not (tmp_path / "k1.lock").exists()
    again, hit = cached_store("k1", tmp_path, rows, MustNotRun(), num_proc=1, strict=False, rank_is_builder=True)
    assert hit and len(calls) == 1 and again.lengths.tolist() == store.lengths.tolist()
    waiter, hit = cached_store("k1", tmp_path, rows, MustNotRun(), num_proc=1, strict=False, rank_is_builder=False)
    assert hit and len(waiter) == len(store)
    other, hit = cached_store("k2", tmp_path, lambda: make_rows(50), WordEncoder(), num_proc=1, strict=False,
                              rank_is_builder=True)
    assert not hit and len(other) == 50
    # a store of another format version is rebuilt in place
    meta = json.loads((tmp_path / "k2" / "meta.json").read_text())
    (tmp_path / "k2" / "meta.json").write_text(json.dumps({**meta, "version": 0}))
    assert not is_complete(tmp_path / "k2")
    rebuilt, hit = cached_store("k2", tmp_path, lambda: make_rows(60), WordEncoder(), num_proc=1, strict=False,
                                rank_is_builder=True)
    assert not hit and len(rebuilt) == 60 and sorted(p.name for p in tmp_path.iterdir()) == ["k1", "k2"]


def test_crash_mid_build_leaves_no_store_and_next_call_rebuilds(tmp_path):
    def crashing():
        yield from make_rows(150)
        yield RowItem("data.jsonl:151", {"text": "CRASH"})
        yield from make_rows(10)

    with pytest.raises(RuntimeError, match=r"data\.jsonl:151: the encoder failed"):
        cached_store("k", tmp_path, crashing, WordEncoder(), num_proc=1, strict=False, rank_is_builder=True,
                     chunk_size=32)
    assert not (tmp_path / "k").exists() and not (tmp_path / "k.lock").exists()
    assert not list(tmp_path.glob(".k.tmp-*"))
    assert "KeyError" in json.loads((tmp_path / "k.failed").read_text())["error"]
    # a temp directory left by a killed build is cleaned up by the next build of that key
    (tmp_path / ".k.tmp-otherhost-1-deadbeef").mkdir()
    store, hit = cached_store("k", tmp_path, lambda: make_rows(150), WordEncoder(), num_proc=1, strict=False,
                              rank_is_builder=True)
    assert not hit and len(store) == 150
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def _build_in_child(root: str, key: str, n: int, delay: float, bad_every: int) -> None:
    cached_store(key, Path(root), lambda: make_rows(n, bad_every=bad_every), SlowEncoder(delay), num_proc=1,
                 strict=bad_every > 0, rank_is_builder=True, chunk_size=20)


def _child(*args):
    # forkserver, like the builder's workers: after the first, a child starts in milliseconds
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=_build_in_child, args=args)
    p.start()
    return p


def _wait_for_lock(lock: Path, proc) -> None:
    """Until the builder holds the lock and has written who it is (O_EXCL creates the file empty first; readers
    in cache.py take an empty one as "being written"; a fresh-clone run here once read it in between)."""
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip().endswith("}")):
        assert proc.is_alive() and time.monotonic() < deadline, "the builder never took the lock"
        time.sleep(0.01)


def test_waiters_and_a_second_builder_wait_for_a_builder_in_another_process(tmp_path):
    proc = _child(str(tmp_path), "k", 120, 0.01, 0)  # ~1.2 s of encoding after start-up
    try:
        _wait_for_lock(tmp_path / "k.lock", proc)
        assert not is_complete(tmp_path / "k")
        info = json.loads((tmp_path / "k.lock").read_text())
        assert info["pid"] == proc.pid and info["host"] == socket.gethostname()
        t0 = time.monotonic()
        store, hit = cached_store("k", tmp_path, lambda: make_rows(120), MustNotRun(), num_proc=1, strict=False,
                                  rank_is_builder=False, poll_s=0.05)
        assert not hit and len(store) == 120 and time.monotonic() - t0 > 0.3
        assert [x.tolist() for x in store.example(7)] == [list(v) for v in expected([*make_rows(8)])[7]]
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    # another run's builder that finds the lock taken waits for it instead of building the key again
    proc = _child(str(tmp_path), "k2", 120, 0.01, 0)
    try:
        _wait_for_lock(tmp_path / "k2.lock", proc)
        store, hit = cached_store("k2", tmp_path, lambda: make_rows(120), MustNotRun(), num_proc=1, strict=False,
                                  rank_is_builder=True, poll_s=0.05)
        assert not hit and len(store) == 120
    finally:
        proc.join(60)
    assert proc.exitcode == 0


def test_waiter_fails_fast_when_the_builder_fails(tmp_path):
    proc = _child(str(tmp_path), "k", 120, 0.005, 50)  # strict: fails at row 50
    try:
        _wait_for_lock(tmp_path / "k.lock", proc)
        with pytest.raises(ShardtuneError, match=r"failed in the building process .*data\.jsonl:50: marked bad"):
            cached_store("k", tmp_path, lambda: make_rows(1), MustNotRun(), num_proc=1, strict=False,
                         rank_is_builder=False, poll_s=0.05, wait_timeout_s=60)
    finally:
        proc.join(60)
    assert proc.exitcode != 0
    with pytest.raises(ShardtuneError, match=r"gave up after 0 s waiting for .*is local rank 0 still tokenizing"):
        cached_store("nobody", tmp_path, lambda: make_rows(1), MustNotRun(), num_proc=1, strict=False,
                     rank_is_builder=False, poll_s=0.05, wait_timeout_s=0.2)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_is_taken_over_and_foreign_lock_waited_for(tmp_path):
    lock = tmp_path / "k.lock"
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "time": time.time()}))
    # a waiter of this run sees the builder died (after a grace period, in case a new builder takes over)
    with pytest.raises(ShardtuneError, match=r"died without finishing"):
        cached_store("k", tmp_path, lambda: make_rows(5), MustNotRun(), num_proc=1, strict=False,
                     rank_is_builder=False, poll_s=0.05)
    # a builder takes the lock over
    store, hit = cached_store("k", tmp_path, lambda: make_rows(30), WordEncoder(), num_proc=1, strict=False,
                              rank_is_builder=True, wait_timeout_s=5)
    assert not hit and len(store) == 30 and not lock.exists()
    # a live pid of this host, and any pid of another host, hold the lock until the timeout
    for info in ({"pid": os.getpid(), "host": socket.gethostname()}, {"pid": 1, "host": "elsewhere"}):
        (tmp_path / "k3.lock").write_text(json.dumps(info))
        with pytest.raises(ShardtuneError, match=r"gave up after 0 s .* delete .*k3\.lock"):
            cached_store("k3", tmp_path, lambda: make_rows(5), WordEncoder(), num_proc=1, strict=False,
                         rank_is_builder=True, wait_timeout_s=0.3, poll_s=0.05)
    assert not (tmp_path / "k3").exists()


# ---- the cache key against the settings that change what is trained ----------------------------------------

def _data_cfg(tmp_path: Path, path: Path, **kw):
    from shardtune.config import DataConfig

    return DataConfig(train_file=str(path), cache_dir=str(tmp_path / "cache"), num_proc=1, eval_fraction=0.0, **kw)


def test_strict_after_a_lenient_run_does_not_reuse_its_cache(tmp_path):
    from shardtune.data.pipeline import build_data
    from shardtune.errors import ShardtuneError
    from shardtune.models.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    path = tmp_path / "some_bad.jsonl"
    path.write_text('{"prompt": "a=", "completion": "b"}\n{"prompt": "a="\n{"prompt": "c=", "completion": "d"}\n')
    lenient = build_data(_data_cfg(tmp_path, path), tok, 16, seed=0)
    assert len(lenient.train) == 2  # the bad row skipped and counted, into the cache
    with pytest.raises(ShardtuneError, match=r"some_bad\.jsonl:2: "):  # the same file, same cache: still stops
        build_data(_data_cfg(tmp_path, path, strict=True), tok, 16, seed=0)


@pytest.mark.parametrize(("name", "content", "says"), [
    ("empty.jsonl", b"", "is empty"),
    ("latin1.jsonl", '{"text": "caf\u00e9 cr\u00e8me"}\n'.encode("latin-1") * 3, "is not UTF-8 text"),
    ("latin1.csv", 'text\ncaf\u00e9\n'.encode("latin-1"), "is not UTF-8 text"),
])
def test_empty_or_not_utf8_file_says_so(tmp_path, name, content, says):
    from shardtune.data.pipeline import build_data
    from shardtune.errors import ShardtuneError
    from shardtune.models.tokenizer import load_tokenizer

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ShardtuneError, match=says) as info:
        build_data(_data_cfg(tmp_path, path), load_tokenizer(None), 16, seed=0)
    assert "no row has the fields" not in str(info.value) and "\n" not in str(info.value)
