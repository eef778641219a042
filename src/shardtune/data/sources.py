"""Reading rows from every supported source: JSON Lines, JSON, Parquet, CSV, folders and `datasets` folders.

`iter_rows(path, split)` yields one `RowItem` per row, streaming: a row that cannot be read (invalid UTF-8,
invalid JSON, not an object, a CSV line with too many fields) becomes ``RowItem(where, None, reason)`` and
reading goes on, so the caller decides whether to skip it or stop (``data.strict``). Anything wrong with
the source as a whole (missing path, unknown kind, unreadable file, unknown split) raises ShardtuneError.

``where`` is ``"path:LINE"`` (1-based physical line, blank lines counted) for line formats (.jsonl, .csv)
and ``"path#INDEX"`` (0-based row index) for row-indexed formats (.json, .parquet, ``datasets`` folders;
``"path/SPLIT#INDEX"`` for a split of a DatasetDict).

`source_fingerprint(path, split)` is a content hash used in the tokenization cache key.

``pyarrow`` and ``datasets`` are imported only when a Parquet file or a ``datasets`` folder is read.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shardtune.data.types import RowItem
from shardtune.errors import ShardtuneError

# File name endings, longest first so ".jsonl.gz" wins over ".gz".
_KINDS = ((".jsonl.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json", "json"), (".parquet", "parquet"),
          (".csv", "csv"))
SUPPORTED = ("a .jsonl, .jsonl.gz, .json, .parquet or .csv file, a folder of them, "
             "or a `datasets` save_to_disk folder")
# Files that mark a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`.
_DATASET_DICT_FILE = "dataset_dict.json"
_DATASET_FILES = ("state.json", "dataset_info.json")
_BLOCK = 1 << 20  # 1 MiB: hashing block size
_PARQUET_BATCH = 1024
_FINGERPRINT_VERSION = b"shardtune-source-v1"


def file_kind(path: str | os.PathLike[str]) -> str | None:
    """The reader for a file name: jsonl, jsonl.gz, json, parquet, csv, or None if unsupported."""
    name = os.fspath(path).lower()
    for suffix, kind in _KINDS:
        if name.endswith(suffix):
            return kind
    return None


def is_saved_dataset(path: str | os.PathLike[str]) -> bool:
    """True for a folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    p = Path(path)
    return p.is_dir() and ((p / _DATASET_DICT_FILE).is_file() or all((p / f).is_file() for f in _DATASET_FILES))


def _unsupported(path: str) -> ShardtuneError:
    return ShardtuneError(f"data source {path!r}: unsupported kind; use {SUPPORTED}")


def _missing(path: str) -> ShardtuneError:
    return ShardtuneError(f"data source {path!r} does not exist; use {SUPPORTED}")


def _walk(root: str) -> list[tuple[str, str]]:
    """(path, kind) of every readable source below a folder, sorted by path; kind 'datasets' for saved datasets.

    Hidden files and folders (a leading dot) are skipped; a ``datasets`` folder inside counts as one source.
    """
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if d.startswith("."):
                continue
            if is_saved_dataset(full):
                found.append((full, "datasets"))
            else:
                keep.append(d)
        dirnames[:] = sorted(keep)
        for f in filenames:
            kind = file_kind(f)
            if kind is not None and not f.startswith("."):
                found.append((os.path.join(dirpath, f), kind))
    return sorted(found, key=lambda item: Path(item[0]).relative_to(root).parts)


def _saved_split(path: str, split: str | None) -> str | None:
    """The split to read of a saved ``datasets`` folder (None for a single Dataset); ShardtuneError if absent."""
    dict_file = Path(path) / _DATASET_DICT_FILE
    if not dict_file.is_file():
        if split is not None:
            raise ShardtuneError(f"data source {path!r} is a single saved Dataset (no splits); "
                                 f"remove split={split!r}")
        return None
    try:
        splits = json.loads(dict_file.read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ShardtuneError(f"data source {path!r}: unreadable {_DATASET_DICT_FILE} ({err})") from None
    want = split or "train"
    if want not in splits:
        raise ShardtuneError(f"data source {path!r}: no split {want!r} in the saved DatasetDict; "
                             f"set split to one of {', '.join(splits)}")
    return want


def _plan(path: str, split: str | None) -> list[tuple[str, str, str | None]]:
    """(path, kind, split) of everything a source is read from; ShardtuneError for a missing or unsupported path.

    In a folder, ``split`` applies to the saved DatasetDicts only.
    """
    p = Path(path)
    if not p.exists():
        raise _missing(path)
    if p.is_dir():
        if is_saved_dataset(p):
            return [(path, "datasets", _saved_split(path, split))]
        plan = [(f, kind, _saved_split(f, split) if kind == "datasets" else None) for f, kind in _walk(path)]
        if not plan:
            raise ShardtuneError(f"data source {path!r}: folder has no supported files; put {SUPPORTED} in it")
        return plan
    kind = file_kind(path)
    if kind is None:
        raise _unsupported(path)
    if split is not None and kind != "json":
        raise ShardtuneError(f"data source {path!r}: split={split!r} applies only to a saved DatasetDict "
                             "(or a .json object of splits); remove it for a single file")
    return [(path, kind, split)]


def iter_rows(path: str, split: str | None = None) -> Iterator[RowItem]:
    """Every row of a source, in a deterministic order; see the module docstring for ``where`` and errors.

    A folder is read file by file, sorted by relative path (recursively; a saved ``datasets`` folder inside
    it is read with ``split``). ``split`` picks a split of a saved DatasetDict (default ``train``) or a key
    of a .json object of splits. A missing or unsupported path, or an unknown split of a saved DatasetDict,
    raises ShardtuneError at once (not at the first row); a file that turns out unreadable raises when
    reading reaches it.
    """
    return _iter_plan(_plan(os.fspath(path), split))


def _iter_plan(plan: list[tuple[str, str, str | None]]) -> Iterator[RowItem]:
    for file, kind, split in plan:
        if kind in ("jsonl", "jsonl.gz"):
            yield from _iter_jsonl(file, gz=kind == "jsonl.gz")
        elif kind == "json":
            yield from _iter_json(file, split)
        elif kind == "parquet":
            yield from _iter_parquet(file)
        elif kind == "csv":
            yield from _iter_csv(file)
        else:
            yield from _iter_saved_dataset(file, split)


# ---------------------------------------------------------------- JSON Lines


def _parse_line(where: str, raw: bytes) -> RowItem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return RowItem(where, None, f"invalid UTF-8 (byte {err.start + 1})")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return RowItem(where, None, f"invalid JSON ({err.msg} at column {err.colno})")
    if not isinstance(row, dict):
        return RowItem(where, None, f"expected a JSON object, got {_json_type(row)}")
    return RowItem(where, row)


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _iter_jsonl(path: str, gz: bool = False) -> Iterator[RowItem]:
    """Line by line as bytes, each line decoded on its own, so one bad line does not stop the file."""
    try:
        f = gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as err:
        raise ShardtuneError(f"data source {path!r}: cannot read ({err})") from None
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
                raise ShardtuneError(f"data source {path!r}: cannot read line {lineno + 1} ({err})") from None
            if not raw:
                return
            lineno += 1
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            if raw.strip():
                yield _parse_line(f"{path}:{lineno}", raw)


# ---------------------------------------------------------------- JSON


def _iter_json(path: str, split: str | None) -> Iterator[RowItem]:
    """A top-level array of objects, or an object holding the array (``data``, a split name, its only list).

    The file is parsed whole (JSON has no streaming form in the standard library); use .jsonl for large
    data. A .json file that is really JSON Lines (several values, one per line) is read as JSON Lines.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ShardtuneError(f"data source {path!r}: cannot read ({err})") from None
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise ShardtuneError(f"data source {path!r}: invalid UTF-8 at byte {err.start}") from None
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and split is None:
            del raw
            yield from _iter_jsonl(path)
            return
        raise ShardtuneError(f"data source {path!r}: invalid JSON ({err.msg} at line {err.lineno} "
                             f"column {err.colno})") from None
    del raw
    rows = _json_rows(path, data, split)
    for i, row in enumerate(rows):
        where = f"{path}#{i}"
        if isinstance(row, dict):
            yield RowItem(where, row)
        else:
            yield RowItem(where, None, f"expected a JSON object, got {_json_type(row)}")


def _json_rows(path: str, data: Any, split: str | None) -> list[Any]:
    if isinstance(data, list):
        if split is not None:
            raise ShardtuneError(f"data source {path!r}: split={split!r} given but the file is one array of rows")
        return data
    if not isinstance(data, dict):
        raise ShardtuneError(f"data source {path!r}: expected an array of objects, got {_json_type(data)}")
    lists = [k for k, v in data.items() if isinstance(v, list)]
    if split is not None:
        if isinstance(data.get(split), list):
            return data[split]
        raise ShardtuneError(f"data source {path!r}: no split {split!r}; lists in the file: "
                             f"{', '.join(map(repr, lists)) or 'none'}")
    if isinstance(data.get("data"), list):
        return data["data"]
    if len(lists) == 1:
        return data[lists[0]]
    if isinstance(data.get("train"), list):
        return data["train"]
    raise ShardtuneError(f"data source {path!r}: expected an array of objects, or an object with one list of "
                         f"them (e.g. under 'data'); found lists {', '.join(map(repr, lists)) or 'none'}")


# ---------------------------------------------------------------- Parquet


def _iter_parquet(path: str) -> Iterator[RowItem]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ShardtuneError(f"data source {path!r}: reading Parquet needs pyarrow; pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise ShardtuneError(f"data source {path!r}: not a readable Parquet file ({err})") from None
    index = 0
    with pf:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH):
            for row in batch.to_pylist():
                yield RowItem(f"{path}#{index}", row)
                index += 1


# ---------------------------------------------------------------- CSV


def _decoded_lines(raw_lines: Iterable[bytes], bad: set[int], empty: set[int]) -> Iterator[str]:
    """Decode each physical line on its own; lines of invalid UTF-8 are decoded with replacement and noted."""
    for lineno, raw in enumerate(raw_lines, start=1):
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        if not raw.rstrip(b"\r\n"):
            empty.add(lineno)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.add(lineno)
            yield raw.decode("utf-8", errors="replace")


def _raise_csv_field_limit() -> None:
    # The csv default (128 KiB per field) is smaller than a long training document.
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:
            limit //= 2


def _iter_csv(path: str) -> Iterator[RowItem]:
    """csv.DictReader over the header row; ``where`` is the line a record starts on."""
    _raise_csv_field_limit()
    bad: set[int] = set()
    empty: set[int] = set()
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as err:
        raise ShardtuneError(f"data source {path!r}: cannot read ({err})") from None
    with f:
        reader = csv.DictReader(_decoded_lines(f, bad, empty))
        try:
            header = reader.fieldnames
        except csv.Error as err:
            raise ShardtuneError(f"data source {path!r}: invalid CSV header ({err})") from None
        if not header:
            return
        last = reader.line_num  # lines consumed by the header
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                yield RowItem(f"{path}:{last + 1}", None, f"invalid CSV ({err})")
                last = reader.line_num
                continue
            first, last = last + 1, reader.line_num
            # DictReader skips empty lines, which still count: the record starts at its first non-empty line.
            while first in empty and first < last:
                first += 1
            where = f"{path}:{first}"
            if bad.intersection(range(first, last + 1)):
                yield RowItem(where, None, "invalid UTF-8")
            elif None in row:
                yield RowItem(where, None, f"{len(header) + len(row[None])} fields but the header has {len(header)}")
            else:
                yield RowItem(where, row)


# ---------------------------------------------------------------- datasets save_to_disk


def _load_saved_dataset(path: str, split: str | None) -> tuple[Any, str]:
    """(Dataset, where-prefix) of a save_to_disk folder and its checked split: memory-mapped, not materialised."""
    try:
        import datasets
    except ImportError:
        raise ShardtuneError(f"data source {path!r} is a `datasets` folder; pip install datasets") from None
    try:
        ds = datasets.load_from_disk(path, keep_in_memory=False)
    except Exception as err:  # datasets raises FileNotFoundError and others for a damaged folder
        raise ShardtuneError(f"data source {path!r}: cannot load the saved dataset ({err})") from None
    if split is not None:
        return ds[split], f"{path}/{split}"
    if not isinstance(ds, datasets.Dataset):
        raise ShardtuneError(f"data source {path!r}: expected a saved Dataset or DatasetDict, got {type(ds).__name__}")
    return ds, path


def _iter_saved_dataset(path: str, split: str | None) -> Iterator[RowItem]:
    ds, prefix = _load_saved_dataset(path, split)
    ds = ds.with_format(None)
    index = 0
    for batch in ds.iter(batch_size=_PARQUET_BATCH):
        columns = list(batch)
        n = len(batch[columns[0]]) if columns else 0
        for j in range(n):
            yield RowItem(f"{prefix}#{index}", {c: batch[c][j] for c in columns})
            index += 1


# ---------------------------------------------------------------- fingerprint


def _hash_file(h: Any, path: str) -> None:
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)


def _files_under(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: Path(p).relative_to(root).parts)


def source_fingerprint(path: str, split: str | None) -> str:
    """A content hash of a source: blake2b over every byte it is read from, plus relative paths and ``split``.

    Cost: reads every byte of the source once, in 1 MiB blocks (about 1 GB/s on one core; nothing is held
    in memory). Equal fingerprints mean the same rows in the same order; any changed byte, renamed, added
    or removed file changes it. For a folder only the files `iter_rows` reads count (all of a saved
    Dataset; ``dataset_dict.json`` and the split's folder of a saved DatasetDict). Raises ShardtuneError
    like `iter_rows` for a missing or unsupported path.
    """
    path = os.fspath(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(_FINGERPRINT_VERSION)
    h.update(b"\0split\0" + (split or "").encode() + (b"\1" if split is not None else b"\0"))
    root = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        for source, kind, part in _plan(path, split):
            if kind != "datasets":
                files = [source]
            elif part is None:
                files = _files_under(source)
            else:  # a DatasetDict keeps each split in a folder of its name: hash that one only
                files = [os.path.join(source, _DATASET_DICT_FILE), *_files_under(os.path.join(source, part))]
            for file in files:
                rel = os.path.relpath(file, root) if os.path.isdir(path) else os.path.basename(file)
                h.update(b"\0file\0" + rel.replace(os.sep, "/").encode("utf-8", "surrogateescape") + b"\0")
                h.update(str(os.path.getsize(file)).encode() + b"\0")
                _hash_file(h, file)
    except OSError as err:
        raise ShardtuneError(f"data source {path!r}: cannot read ({err})") from None
    return h.hexdigest()
