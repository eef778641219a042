"""Folders shardtune writes for users (an export, OUTPUT_DIR/model, OUTPUT_DIR/adapter): the marker that
says shardtune wrote one, the rule for writing over what is there, and the atomic swap.

The rule: never remove what shardtune did not write. A plain file at the target is always refused; an
empty folder is fine; a non-empty folder is replaced only when it carries shardtune's marker for the same
kind of output, or when the user said `--overwrite`. Staging folders get fresh names, so no
clean-up ever removes a folder by a name that a user could have picked too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.config import Config

MARKER = ".shardtune-export.json"
Kind = Literal["model", "adapter"]


def read_marker(folder: Path) -> dict | None:
    """The marker of a folder shardtune wrote, or None (no marker, or one that is not shardtune's JSON)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == "shardtune" else None


EXPORT_FIX = "give a new or empty folder, or add --overwrite to replace it and everything in it"


def check_output_dir(out: Path, kind: Kind, *, overwrite: bool = False, fix: str = EXPORT_FIX) -> None:
    """Raise ShardtuneError (one line) if writing a `kind` folder at `out` could remove what shardtune did
    not write. `fix` tells the user what to do instead (the command's --overwrite, another folder)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ShardtuneError(f"{out} is a file; shardtune writes the {kind} as a folder there and never replaces a "
                             "file; move the file, or give another path")
    if not out.is_dir() or overwrite or not any(out.iterdir()):
        return
    marker = read_marker(out)
    if marker is None:
        raise ShardtuneError(f"{out} is a folder with files that shardtune did not write (no {MARKER}); {fix}")
    if marker.get("kind") != kind:
        raise ShardtuneError(f"{out} holds a shardtune {marker.get('kind')} export, not a {kind}; {fix}")


def finished_run(output_dir: Path) -> dict | None:
    """summary.json of a run that finished in `output_dir` (exit code 0), or None: no run, one that was
    stopped (it resumes from its checkpoint), or a summary that is not shardtune's."""
    try:
        summary = json.loads((Path(output_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("exit_code") == 0 else None


def check_not_finished(cfg: Config, overwrite: bool = False) -> None:
    """A run refuses an output folder that holds a finished run (its metrics, checkpoints and summary would be
    written over), unless it resumes that run or the user said --overwrite."""
    if overwrite or cfg.checkpoint.resume:
        return
    done = finished_run(Path(cfg.train.output_dir))
    if done is not None:
        raise ShardtuneError(f"train.output_dir: {cfg.train.output_dir!r} holds a finished run ({done.get('steps')} "
                             "steps, summary.json); give another --output-dir, --resume auto to continue it (with a "
                             "larger train.max_steps), or --overwrite to train there again from the start")


def clear_finished_run(cfg: Config) -> list[Path]:
    """`train --overwrite` over a finished run: remove what that run wrote that the new one would take for
    its own (summary.json and its checkpoints, folders with shardtune's manifest), so `--resume auto` and
    checkpoint.keep_last see only the new run's. Its final model/adapter is replaced at the end as before.
    Returns what was removed."""
    from shardtune.checkpoint.layout import checkpoint_root, complete_checkpoints

    out = Path(cfg.train.output_dir)
    if finished_run(out) is None:
        return []
    removed = complete_checkpoints(checkpoint_root(cfg.checkpoint, out))
    for path in removed:
        shutil.rmtree(path)
    (out / "summary.json").unlink()
    return [*removed, out / "summary.json"]


def check_final_dir(cfg: Config, overwrite: bool = False) -> None:
    """The folder a finished run writes (OUTPUT_DIR/model, or adapter with LoRA) must be new, empty or an
    earlier one of shardtune's of the same kind, unless --overwrite: checked before training, not after it.
    Nor may the output folder hold a finished run that this one does not resume (check_not_finished)."""
    check_not_finished(cfg, overwrite)
    if not cfg.checkpoint.save_final:
        return
    kind: Kind = "adapter" if cfg.peft.method != "none" else "model"
    check_output_dir(Path(cfg.train.output_dir) / kind, kind, overwrite=overwrite,
                     fix="use another --output-dir, or add --overwrite to `shardtune train` to replace it and "
                         "everything in it")


def staging_dir(out: Path, kind: Kind, source: str) -> Path:
    """A new hidden folder next to `out` to write into, marked as shardtune's from the start, after
    removing the leftovers of earlier attempts that were killed (marked, and their process is gone)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    # A fresh name (the writer's pid, for the clean-up above, and a random part): never someone else's folder.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    write_marker(tmp, kind, source)
    return tmp


def _abandoned(stale: Path) -> bool:
    """A staging folder of a shardtune process that no longer runs (on this machine)."""
    if stale.is_symlink() or not stale.is_dir() or read_marker(stale) is None:
        return False
    pid = stale.name.rsplit(".tmp-", 1)[-1].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # running under another user
        return False
    return False


@contextlib.contextmanager
def staged(out: Path, kind: Kind, source: str, *, overwrite: bool = False, check_first: bool = True) -> Iterator[Path]:
    """Write a `kind` folder at `out`: checks the rule first (unless check_first=False: a collective write
    checks only at the swap, after every rank has joined), yields a staging folder, and swaps it into
    place when the block ends without an error (else removes it, leaving `out` as it was)."""
    if check_first:
        check_output_dir(out, kind, overwrite=overwrite)
    tmp = staging_dir(out, kind, source)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        replace_dir(tmp, out, kind, overwrite=overwrite)
    except ShardtuneError as err:
        # `out` changed while we wrote (hours, for a training run): keep what was written under a visible name.
        keep = out.with_name(f"{out.name}-{uuid.uuid4().hex[:8]}")
        os.replace(tmp, keep)
        raise ShardtuneError(f"{err}; the {kind} just written is in {keep}") from None


def write_marker(folder: Path, kind: Kind, source: str) -> None:
    """`folder`/.shardtune-export.json: what wrote the folder, for the next write to recognise."""
    marker = {"written_by": "shardtune", "kind": kind, "source": source, "shardtune_version": _version()}
    (Path(folder) / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _version() -> str | None:
    """The installed shardtune's version (the package root, which holds __version__, sits above this layer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardtune")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return None


def replace_dir(new: Path, final: Path, kind: Kind, *, overwrite: bool = False) -> None:
    """Swap the complete folder `new` into `final`, so a good earlier folder is never half-overwritten.

    The rule is checked again here, right before anything moves: a training run checks at its start,
    and the folder may have changed in the hours since."""
    check_output_dir(final, kind, overwrite=overwrite)
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}")
    if final.exists() or final.is_symlink():
        os.replace(final, old)
    try:
        os.replace(new, final)
    except OSError:
        if old.exists() or old.is_symlink():
            os.replace(old, final)
        raise
    if old.is_symlink():  # a link to a folder: the link goes, the folder it points to is left alone
        old.unlink()
    elif old.exists():
        shutil.rmtree(old, ignore_errors=True)
