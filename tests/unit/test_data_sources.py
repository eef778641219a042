"""Reading rows from every source kind: where each row came from, bad lines as error items, fingerprints."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shardtune.data.sources import file_kind, is_saved_dataset, iter_rows, source_fingerprint
from shardtune.data.types import RowItem
from shardtune.errors import ShardtuneError


def _rows(path, split=None) -> list[tuple[str, dict | None, str | None]]:
    return [(item.where, item.row, item.error) for item in iter_rows(str(path), split)]


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- JSON Lines


def test_jsonl_line_numbers_count_blank_lines(tmp_path):
    p = _write_bytes(tmp_path / "d.jsonl", b'{"text": "a"}\n\n  \n{"text": "b"}\r\n{"text": "c"}')
    assert _rows(p) == [(f"{p}:1", {"text": "a"}, None), (f"{p}:4", {"text": "b"}, None),
                        (f"{p}:5", {"text": "c"}, None)]
    assert all(isinstance(item, RowItem) for item in iter_rows(str(p)))


def test_jsonl_bad_lines_become_error_items_and_reading_goes_on(tmp_path):
    p = _write_bytes(tmp_path / "d.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": \n[1, 2]\n"str"\n'
                                           b'{"text": "\xc3\xa9 fine"}\n')
    rows = _rows(p)
    assert [r[0] for r in rows] == [f"{p}:{i}" for i in range(1, 7)]
    assert rows[0] == (f"{p}:1", {"text": "ok"}, None)
    assert rows[1][1] is None and rows[1][2].startswith("invalid UTF-8")
    assert rows[2][1] is None and rows[2][2].startswith("invalid JSON (Expecting value")
    assert rows[3] == (f"{p}:4", None, "expected a JSON object, got an array")
    assert rows[4] == (f"{p}:5", None, "expected a JSON object, got a string")
    assert rows[5] == (f"{p}:6", {"text": "é fine"}, None)


def test_jsonl_utf8_bom_and_gzip(tmp_path):
    p = _write_bytes(tmp_path / "bom.jsonl", b'\xef\xbb\xbf{"a": 1}\n')
    assert _rows(p) == [(f"{p}:1", {"a": 1}, None)]
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"a": 1}\n\n{"a": 2\n')
    rows = _rows(gz)
    assert rows[0] == (f"{gz}:1", {"a": 1}, None)
    assert rows[1][0] == f"{gz}:3" and rows[1][2].startswith("invalid JSON")


def test_jsonl_streams_lazily(tmp_path):
    p = tmp_path / "big.jsonl"
    p.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))
    it = iter_rows(str(p))
    assert next(it).row == {"i": 0}
    assert next(it).row == {"i": 1}


# ---------------------------------------------------------------- JSON


def test_json_array_and_object_with_list(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"text": "x"}, 3, {"text": "y"}]))
    assert _rows(arr) == [(f"{arr}#0", {"text": "x"}, None), (f"{arr}#1", None, "expected a JSON object, got a number"),
                          (f"{arr}#2", {"text": "y"}, None)]
    obj = tmp_path / "o.json"
    obj.write_text(json.dumps({"version": 2, "data": [{"text": "x"}]}))
    assert _rows(obj) == [(f"{obj}#0", {"text": "x"}, None)]
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"meta": {}, "rows": [{"text": "z"}]}))
    assert _rows(one) == [(f"{one}#0", {"text": "z"}, None)]
    splits = tmp_path / "s.json"
    splits.write_text(json.dumps({"train": [{"t": 1}], "test": [{"t": 2}]}))
    assert _rows(splits) == [(f"{splits}#0", {"t": 1}, None)]
    assert _rows(splits, "test") == [(f"{splits}#0", {"t": 2}, None)]
    with pytest.raises(ShardtuneError, match="no split 'dev'"):
        _rows(splits, "dev")


def test_json_that_is_json_lines_reads_as_lines(tmp_path):
    p = tmp_path / "lines.json"
    p.write_text('{"a": 1}\n{"a": 2}\n')
    assert _rows(p) == [(f"{p}:1", {"a": 1}, None), (f"{p}:2", {"a": 2}, None)]


def test_json_whole_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"a": 1},')
    with pytest.raises(ShardtuneError, match=r"bad\.json.*invalid JSON"):
        _rows(bad)
    scalar = tmp_path / "n.json"
    scalar.write_text("3")
    with pytest.raises(ShardtuneError, match="expected an array of objects"):
        _rows(scalar)
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"x": [], "y": []}))
    with pytest.raises(ShardtuneError, match="found lists 'x', 'y'"):
        _rows(two)


# ---------------------------------------------------------------- CSV


def test_csv_rows_and_line_numbers(tmp_path):
    p = _write_bytes(tmp_path / "d.csv", b'prompt,completion\n1+1=,2\n\n"multi\nline",x\n'
                                         b'a,b,extra\nbad\xff,y\nlast,z\n')
    rows = _rows(p)
    assert rows[0] == (f"{p}:2", {"prompt": "1+1=", "completion": "2"}, None)
    assert rows[1] == (f"{p}:4", {"prompt": "multi\nline", "completion": "x"}, None)
    assert rows[2] == (f"{p}:6", None, "3 fields but the header has 2")
    assert rows[3] == (f"{p}:7", None, "invalid UTF-8")
    assert rows[4] == (f"{p}:8", {"prompt": "last", "completion": "z"}, None)
    assert len(rows) == 5


def test_csv_long_field(tmp_path):
    p = tmp_path / "long.csv"
    p.write_text("text\n" + "x" * 300_000 + "\n")
    assert _rows(p)[0][1] == {"text": "x" * 300_000}


# ---------------------------------------------------------------- Parquet


def test_parquet_rows_across_batches(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    n = 2500  # more than one read batch and several row groups
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)], "completion": [str(i) for i in range(n)]}),
                   p, row_group_size=1000)
    rows = _rows(p)
    assert len(rows) == n
    assert rows[0] == (f"{p}#0", {"prompt": "p0", "completion": "0"}, None)
    assert rows[-1] == (f"{p}#{n - 1}", {"prompt": f"p{n - 1}", "completion": str(n - 1)}, None)


def test_parquet_nested_messages(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "chat.parquet"
    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    pq.write_table(pa.table({"messages": msgs}), p)
    assert _rows(p) == [(f"{p}#0", {"messages": msgs[0]}, None)]


def test_not_a_parquet_file(tmp_path):
    pytest.importorskip("pyarrow")
    p = tmp_path / "fake.parquet"
    p.write_text("not parquet")
    with pytest.raises(ShardtuneError, match="not a readable Parquet file"):
        _rows(p)


# ---------------------------------------------------------------- datasets save_to_disk


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("saved")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(5)], "n": list(range(5))})
    ds.save_to_disk(str(root / "ds"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
                               "test": datasets.Dataset.from_dict({"text": ["c"]})})
    dd.save_to_disk(str(root / "dd"))
    return root


def test_saved_dataset(saved):
    ds = saved / "ds"
    assert is_saved_dataset(ds)
    assert _rows(ds) == [(f"{ds}#{i}", {"text": f"t{i}", "n": i}, None) for i in range(5)]
    with pytest.raises(ShardtuneError, match="single saved Dataset"):
        _rows(ds, "test")


def test_saved_dataset_dict_splits(saved):
    dd = saved / "dd"
    assert is_saved_dataset(dd)
    assert _rows(dd) == [(f"{dd}/train#0", {"text": "a"}, None), (f"{dd}/train#1", {"text": "b"}, None)]
    assert _rows(dd, "test") == [(f"{dd}/test#0", {"text": "c"}, None)]
    with pytest.raises(ShardtuneError, match=r"no split 'validation'.*one of train, test") as info:
        _rows(dd, "validation")
    assert "\n" not in str(info.value)


def test_saved_dataset_fingerprint_depends_on_split(saved, tmp_path):
    import shutil

    dd = tmp_path / "dd"
    shutil.copytree(saved / "dd", dd)
    train, test = source_fingerprint(str(dd), None), source_fingerprint(str(dd), "test")
    assert train != test and test == source_fingerprint(str(dd), "test")
    assert source_fingerprint(str(saved / "ds"), None) != train
    arrow = next((dd / "test").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes() + b"\0")
    assert source_fingerprint(str(dd), "test") != test
    assert source_fingerprint(str(dd), None) == train  # another split's files do not count


# ---------------------------------------------------------------- folders


def test_directory_reads_every_supported_file_sorted(tmp_path, saved):
    root = tmp_path / "mix"
    (root / "b").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.jsonl").write_text('{"k": "a"}\n')
    (root / "b" / "c.csv").write_text("k\nc\n")
    (root / "b" / "a.json").write_text('[{"k": "ba"}]')
    (root / "z.txt").write_text("ignored")
    (root / ".hidden" / "x.jsonl").write_text('{"k": "hidden"}\n')
    (root / ".dot.jsonl").write_text('{"k": "dot"}\n')
    import shutil

    shutil.copytree(saved / "dd", root / "c_saved")
    rows = _rows(root)
    assert [r[1]["k"] if "k" in r[1] else r[1]["text"] for r in rows] == ["a", "ba", "c", "a", "b"]
    assert rows[0][0] == f"{root}/a.jsonl:1"
    assert rows[1][0] == f"{root}/b/a.json#0"
    assert rows[2][0] == f"{root}/b/c.csv:2"
    assert rows[3][0] == f"{root}/c_saved/train#0"
    # split reaches the saved DatasetDict only
    assert [r[1] for r in _rows(root, "test")][-1] == {"text": "c"}


def test_empty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ShardtuneError, match="no supported files"):
        _rows(tmp_path)


# ---------------------------------------------------------------- errors and fingerprint


@pytest.mark.parametrize("name", ["d.txt", "d.tsv", "d.jsonl.bz2", "d"])
def test_unknown_extension(tmp_path, name):
    p = tmp_path / name
    p.write_text("x")
    with pytest.raises(ShardtuneError, match=r"unsupported kind.*\.jsonl.*\.parquet.*save_to_disk") as info:
        _rows(p)
    assert "\n" not in str(info.value) and name in str(info.value)
    with pytest.raises(ShardtuneError):
        source_fingerprint(str(p), None)


def test_missing_path(tmp_path):
    with pytest.raises(ShardtuneError, match=r"nope\.jsonl' does not exist.*\.csv"):
        _rows(tmp_path / "nope.jsonl")
    with pytest.raises(ShardtuneError, match="does not exist"):
        source_fingerprint(str(tmp_path / "nope.jsonl"), None)


def test_source_errors_raise_when_called_not_when_iterated(tmp_path, saved):
    with pytest.raises(ShardtuneError, match="does not exist"):
        iter_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ShardtuneError, match="no split 'dev'"):
        iter_rows(str(saved / "dd"), "dev")


def test_split_on_a_plain_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"a": 1}\n')
    with pytest.raises(ShardtuneError, match="split='test' applies only"):
        _rows(p, "test")


def test_file_kind():
    assert [file_kind(n) for n in ["a.jsonl", "A.JSONL", "a.jsonl.gz", "a.json", "a.parquet", "a.csv", "a.gz"]] == [
        "jsonl", "jsonl", "jsonl.gz", "json", "parquet", "csv", None]


def test_fingerprint_changes_with_any_byte(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "abc"}\n' * 100_000)  # > 1 MiB: several hash blocks
    a = source_fingerprint(str(p), None)
    assert a == source_fingerprint(str(p), None)
    assert len(a) == 32
    data = bytearray(p.read_bytes())
    data[len(data) - 3] ^= 1
    p.write_bytes(bytes(data))
    assert source_fingerprint(str(p), None) != a


def test_fingerprint_of_directory_tracks_names_and_files(tmp_path):
    root = tmp_path / "dir"
    root.mkdir()
    (root / "a.jsonl").write_text('{"t": 1}\n')
    base = source_fingerprint(str(root), None)
    (root / "b.jsonl").write_text('{"t": 2}\n')
    added = source_fingerprint(str(root), None)
    assert added != base
    (root / "b.jsonl").rename(root / "c.jsonl")
    assert source_fingerprint(str(root), None) != added
    (root / "notes.txt").write_text("not read, not hashed")
    assert source_fingerprint(str(root), None) == source_fingerprint(str(root), None)
    renamed = source_fingerprint(str(root), None)
    (root / "notes.txt").write_text("changed")
    assert source_fingerprint(str(root), None) == renamed
