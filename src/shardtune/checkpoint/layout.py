"""The layout of a checkpoint, whatever format holds its tensors (checkpoint/formats.py).

A checkpoint is a directory `step-NNNNNNNN/` holding:
  (the format's files)   model and optimizer state: DCP's *.distcp + .metadata (dcp_files.py), or the
                         deepspeed backend's own files under deepspeed/state/ (deepspeed_files.py)
  trainer_state.json     step, sampler position, LR schedule, loss scaler, batch geometry, config
  rng/rank{R}.safetensors  each rank's RNG states
  hf/                    config.json + tokenizer, so `shardtune export` needs nothing else
  manifest.json          written last: the format's name, and every file with its size and CRC32

It is written under a temporary name and renamed into place by rank 0 only when every rank has
finished (`finalize`), so a crash or kill -9 at any moment leaves the previous checkpoint intact; a
directory without a valid manifest is never treated as a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
# The manifest's CRC32 pass reads the files in parallel (zlib releases the GIL).
CRC_THREADS = 8


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
    if manifest is None:
        return False
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["size"]:
            return False
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if is_complete(p)]


def resolve_checkpoint(value: str, default_root: Path | None = None) -> Path | None:
    """`auto` -> the newest complete checkpoint under default_root (None if there is none); a path ->
    that checkpoint, or the newest one in a run directory or checkpoints folder. Raises for a
    path that holds no complete checkpoint."""
    if value == "auto":
        found = complete_checkpoints(default_root) if default_root else []
        return found[-1] if found else None
    path = Path(value)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if path.is_dir() and (path / MANIFEST).exists():
        raise ShardtuneError(f"checkpoint {value!r} is incomplete or damaged (files missing or of the wrong size); "
                             "resume from an earlier one or use --resume auto")
    raise ShardtuneError(f"checkpoint {value!r}: no complete checkpoint there; give a step-NNNNNNNN directory, "
                         "a run directory, or --resume auto")


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as err:
        raise ShardtuneError(f"{path}: cannot read {TRAINER_STATE} ({err})") from None



# ---- writing ------------------------------------------------------------------------------------------

def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


def _synced_file_info(path: Path) -> dict[str, int]:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


def finalize(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: manifest last, then one atomic rename into place."""
    paths = sorted(p for p in tmp.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, os.cpu_count() or 1)) as pool:
        files = dict(zip((str(f.relative_to(tmp)) for f in paths), pool.map(_synced_file_info, paths), strict=True))
    manifest = {"version": VERSION, **info, "files": files, "created": time.time()}
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
    """Check every file's size and CRC32 against the manifest (reads the whole checkpoint)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise ShardtuneError(f"{path}: no valid {MANIFEST}; not a complete checkpoint")
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["size"] or _crc32(f) != info["crc32"]:
            raise ShardtuneError(f"{path}: {rel} does not match the manifest (damaged checkpoint)")
