"""The layout of a checkpoint, whatever format holds its tensors (checkpoint/formats.py).

A checkpoint is a directory `step-NNNNNNNN/` holding:
  (the format's files)   model and optimizer state: DCP's *.distcp + .metadata (dcp_files.py), or the
                         deepspeed backend's own files under deepspeed/state/ (deepspeed_files.py)
  trainer_state.json     step, sampler position, LR schedule, loss scaler, batch geometry, config
  rng/rank{R}.safetensors  each rank's RNG states
  hf/                    config.json + tokenizer, so `shardtune export` needs nothing else
  manifest.json          written last: the format's name, and every file with its size and checksum
                         (xxh3_64 when the xxhash package is there, which `datasets` installs; else CRC32)

It is written under a temporary name and renamed into place by rank 0 only when every rank has
finished (`finalize`), so a crash or kill -9 at any moment leaves the previous checkpoint intact; a
directory without a valid manifest is never treated as a checkpoint. Resume and export read every file
back against the manifest (`verify`, files in parallel) before they trust a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardtune.config import CheckpointConfig
from shardtune.errors import ShardtuneError
from shardtune.fileio import fsync_dir

VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# The checksum passes read the files in parallel (zlib and xxhash release the GIL on large buffers).
CRC_THREADS = 8
# Set by the launcher to the checkpoint it verified, so the workers it starts do not read it all again.
VERIFIED_ENV = "SHARDTUNE_VERIFIED_CHECKPOINT"
_BLOCK = 1 << 24  # 16 MiB reads: few enough calls that the hash, not Python, sets the pace
try:  # xxh3 hashes ~4x faster than zlib's CRC32 on one core; xxhash comes with `datasets`, so it is a soft need
    import xxhash
except ImportError:  # pragma: no cover - only without datasets' dependency
    xxhash = None


# ---- finding checkpoints ----------------------------------------------------------------------------

def checkpoint_root(cfg: CheckpointConfig, output_dir: str | Path) -> Path:
    """Where a run's checkpoints go: checkpoint.dir, else OUTPUT_DIR/checkpoints."""
    return Path(cfg.dir) if cfg.dir else Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == VERSION else None


def is_complete(path: Path) -> bool:
    """A manifest of this version, and every file it lists present with its recorded size."""
    manifest = read_manifest(path)
    return manifest is not None and _size_problem(path, manifest) is None


def _size_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    """The first file of the manifest that is missing or of another size, as a message; None if there is none."""
    for rel, info in manifest["files"].items():
        problem = _file_problem(path, rel, info, checksum=False)
        if problem:
            return _damaged(path, rel, problem)
    return None


def _with_manifest(root: Path) -> list[Path]:
    """Step directories under root with a manifest of this version (complete or damaged), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if read_manifest(p) is not None]


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    return [p for p in _with_manifest(root) if is_complete(p)]


def resolve_checkpoint(value: str, default_root: Path | None = None, *, check: bool = False) -> Path | None:
    """`auto` -> the newest complete checkpoint under default_root (None if there is none); a path ->
    that checkpoint, or the newest one in a run directory or checkpoints folder. Raises for a
    path that holds no complete checkpoint.

    A checkpoint with a missing or truncated file is damaged; with `check`, also one whose file's checksum
    differs from the manifest's (`verify` reads every file). A damaged checkpoint named by its own path is
    refused, naming the file; with `auto` or a run directory the newest intact one is taken instead, saying
    so on stderr, and only when every one is damaged is the resume refused."""
    path = Path(value)
    if value != "auto" and (manifest := read_manifest(path)) is not None:
        if check:
            verify(path)
        elif problem := _size_problem(path, manifest):
            raise ShardtuneError(problem)
        return path
    roots = [default_root] if value == "auto" else [path, path / "checkpoints"]
    for root in roots:
        found = _with_manifest(root) if root else []
        if found:
            return _newest_intact(found, check)
    if value == "auto":
        return None
    raise ShardtuneError(f"checkpoint {value!r}: no complete checkpoint there; give a step-NNNNNNNN directory, "
                         "a run directory, or --resume auto")


def _newest_intact(found: list[Path], check: bool) -> Path:
    """The newest of `found` (oldest first) that is intact; one stderr line for each damaged one passed over."""
    for i in range(len(found) - 1, -1, -1):
        try:
            if check:
                verify(found[i])
            elif problem := _size_problem(found[i], read_manifest(found[i]) or {"files": {}}):
                raise ShardtuneError(problem)
            return found[i]
        except ShardtuneError as err:
            if i == 0:
                raise ShardtuneError(f"{err}; no earlier intact checkpoint to fall back to (delete the damaged "
                                     "ones to start over, or resume from a copy)") from None
            print(f"warning: {err}; falling back to the previous checkpoint {found[i - 1]}", file=sys.stderr,
                  flush=True)
    raise AssertionError("unreachable")


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as err:
        raise ShardtuneError(f"{path}: cannot read {TRAINER_STATE} ({err})") from None



# ---- writing ------------------------------------------------------------------------------------------

def _checksums(path: Path, kinds: tuple[str, ...]) -> dict[str, int | str]:
    """The file's checksums named in `kinds` ("xxh3_64", "crc32"), in one read."""
    crc = 0
    xxh = xxhash.xxh3_64() if "xxh3_64" in kinds else None
    with path.open("rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            block = view[:n]
            if xxh is not None:
                xxh.update(block)
            if "crc32" in kinds:
                crc = zlib.crc32(block, crc)
    out: dict[str, int | str] = {}
    if xxh is not None:
        out["xxh3_64"] = xxh.hexdigest()
    if "crc32" in kinds:
        out["crc32"] = crc
    return out


def _synced_file_info(path: Path) -> dict[str, int | str]:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    return {"size": path.stat().st_size, **_checksums(path, ("xxh3_64",) if xxhash else ("crc32",))}


SUMS_DIR = ".sums"  # under a checkpoint being written: each rank's checksums of the files it wrote


def record_own(tmp: Path, paths: list[Path], rank: int, tag: str) -> None:
    """Checksum files this rank wrote (fsync'd, read back here, on the node that wrote them) and leave the results
    for `finalize` in tmp/.sums/TAG-rankR.json, so rank 0 never reads another rank's (another node's) files.
    Written under a temporary name and renamed: finalize sees a whole record or none."""
    if not paths:
        return
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, os.cpu_count() or 1, len(paths))) as pool:
        infos = list(pool.map(_synced_file_info, paths))
    record = {str(p.relative_to(tmp)): {**info, "by": rank} for p, info in zip(paths, infos, strict=True)}
    sums = tmp / SUMS_DIR
    sums.mkdir(exist_ok=True)
    part = sums / f".{tag}-rank{rank}.json.part"
    part.write_text(json.dumps(record))
    with part.open("rb") as handle:
        os.fsync(handle.fileno())
    os.replace(part, sums / f"{tag}-rank{rank}.json")


def _recorded(tmp: Path) -> dict[str, dict[str, Any]]:
    """Every rank's records (record_own), by file."""
    out: dict[str, dict[str, Any]] = {}
    for record in sorted((tmp / SUMS_DIR).glob("*.json")):
        out.update(json.loads(record.read_text()))
    return out


def finalize(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: manifest last, then one atomic rename into place.

    A file that its rank checksummed (record_own) is taken from that record when its size still matches; rank 0
    reads only the rest (its own files, and any a rank did not record)."""
    recorded = _recorded(tmp)
    shutil.rmtree(tmp / SUMS_DIR, ignore_errors=True)
    paths = sorted(p for p in tmp.rglob("*") if p.is_file())
    files: dict[str, dict[str, Any]] = {}
    todo = []
    for f in paths:
        rel = str(f.relative_to(tmp))
        entry = recorded.get(rel)
        if entry is not None and entry["size"] == f.stat().st_size:
            files[rel] = entry
        else:
            todo.append(f)
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, os.cpu_count() or 1)) as pool:
        files.update(zip((str(f.relative_to(tmp)) for f in todo),
                         ({**i, "by": 0} for i in pool.map(_synced_file_info, todo)), strict=True))
    manifest = {"version": VERSION, **info, "files": dict(sorted(files.items())), "created": time.time()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_dir(tmp)
    if final.exists():  # the same step written again (e.g. a resumed run with nothing left to do)
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def verify(path: Path) -> None:
    """Read every file back and check its size and checksum against the manifest, files in parallel. Raises
    ShardtuneError naming the first damaged file (missing, truncated or grown, or changed in place)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise ShardtuneError(f"{path}: no valid {MANIFEST}; not a complete checkpoint")
    if problem := _size_problem(path, manifest):  # cheap, and before reading gigabytes
        raise ShardtuneError(problem)
    files = sorted(manifest["files"].items(), key=lambda kv: -int(kv[1]["size"]))  # big ones first: even load
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, os.cpu_count() or 1)) as pool:
        problems = list(pool.map(lambda item: _file_problem(path, *item), files))
    for (rel, _), problem in zip(files, problems, strict=True):
        if problem:
            raise ShardtuneError(_damaged(path, rel, problem))


def _damaged(path: Path, rel: str, problem: str) -> str:
    return (f"checkpoint {path} is damaged: {rel} does not match the manifest ({problem}); refused: resume from "
            "an earlier checkpoint, or with --resume auto, which takes the newest intact one")


def _file_problem(root: Path, rel: str, info: dict[str, Any], checksum: bool = True) -> str | None:
    """Why one file does not match its manifest entry (size, and with `checksum` its contents), or None."""
    f = root / rel
    if not f.is_file():
        return "missing"
    size = f.stat().st_size
    if size != info["size"]:
        return f"{size:,} bytes, the manifest says {info['size']:,}: truncated or overwritten"
    kinds = ("xxh3_64",) if "xxh3_64" in info and xxhash else ("crc32",) if "crc32" in info else ()
    if not checksum or not kinds:  # xxh3 written where xxhash was installed and this Python lacks it: size only
        return None
    kind = kinds[0]
    if _checksums(f, kinds)[kind] != info[kind]:
        return f"its {kind} checksum differs: the contents changed"
    return None
