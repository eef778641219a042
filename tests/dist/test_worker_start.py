"""SHARDTUNE_WORKER_START=forkserver (shardtune/workerstart.py): workers forked from a preloaded forkserver."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from conftest import ROOT, descendants, run_cli, torchrun

from shardtune.workerstart import WORKER_START_ENV, start_forkserver

pytestmark = pytest.mark.dist

TINY = str(ROOT / "examples" / "tiny.yaml")


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and not r.get("eval")}


def _workers_seen(stop: threading.Event, seen: dict[int, tuple[str, str]], before: set[int]) -> None:
    """The workers below this process, by pid: (their command line, their parent's). A worker is a process that
    torchrun's agent started with a RANK (Popen: /proc/PID/environ holds it) or a child of the forkserver (a fork,
    which never exec'd: its environ is still the forkserver's, and its command line too)."""
    while not stop.is_set():
        for pid in set(descendants(os.getpid())) - before:  # not another test's forkserver left in this process
            try:
                ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                parent = Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace")
                own = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                ranked = b"\0RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
            except (OSError, IndexError):
                continue
            if ranked or "multiprocessing.forkserver" in parent:
                seen[pid] = (own, parent)
        stop.wait(0.05)


def test_forkserver_workers_are_forked_preloaded_and_train_as_popen_ones_do(tmp_path, data_cache):
    def launch(name: str, mode: str) -> dict[int, tuple[str, str]]:
        stop, seen = threading.Event(), {}
        before = set(descendants(os.getpid()))
        watcher = threading.Thread(target=_workers_seen, args=(stop, seen, before), daemon=True)
        watcher.start()
        try:
            proc = run_cli("train", TINY, "--nproc", "2", "--output-dir", str(tmp_path / name), "train.max_steps=3",
                           "log.every=1", "log.progress=false", "train.eval_batches=1",
                           f"data.cache_dir={data_cache}", env={WORKER_START_ENV: mode})
        finally:
            stop.set()
            watcher.join()
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "zero3 on 2 x cpu" in proc.stderr  # the launcher's lines, and the workers' (below), where they were
        assert "step 3" in proc.stderr, proc.stderr[-2000:]
        return seen

    # Started here, outside the launches' captured output: the workers' lines must reach the launcher's stderr, not
    # the forkserver's (as in a session, where the first launch started it).
    server = start_forkserver()
    popen = launch("popen", "")
    assert len(popen) == 2 and all("-m\0shardtune\0train" in own for own, _ in popen.values()), popen
    forked = launch("forkserver", "forkserver")
    assert len(forked) == 2, forked
    for own, parent in forked.values():  # forked, not exec'd, from the forkserver that imported the loop
        assert own == parent and "multiprocessing.forkserver" in own and "shardtune.train.loop" in own
    assert _losses(tmp_path / "forkserver") == _losses(tmp_path / "popen")
    # It only imported: a process that has started a thread pool (OpenMP's, after a parallel op) must not fork.
    assert len(os.listdir(f"/proc/{server}/task")) == 1


SCRIPT = """import gc, json, os, sys
start_modules = sorted(m for m in ("transformers", "shardtune.train.loop") if m in sys.modules)
frozen = gc.get_freeze_count()
from shardtune.dist import clean_exit, init_distributed
ctx = init_distributed()
cmdline = open("/proc/self/cmdline", "rb").read().decode(errors="replace")
out = os.path.join(sys.argv[1], f"rank{ctx.rank}.json")
json.dump({"argv": sys.argv, "world": ctx.world, "cmdline": cmdline, "preloaded": start_modules,
           "path0": sys.path[0], "frozen": frozen}, open(out, "w"))
print(f"rank {ctx.rank} wrote {out}")
clean_exit(0)
"""


def test_the_tests_script_launches_fork_their_workers_too(tmp_path):
    """conftest.torchrun (every multi-process test's worker script) under the forkserver: the workers are forked
    from it with its imports done, run the script as `python SCRIPT ARGS` would (argv, its folder first on
    sys.path), in one process group, and their lines reach the caller."""
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    proc = torchrun(2, [str(script), str(tmp_path), "x"])
    assert "rank 0 wrote" in proc.stdout and "rank 1 wrote" in proc.stdout, proc.stdout
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["argv"] == [str(script), str(tmp_path), "x"] and got["world"] == 2
        assert "multiprocessing.forkserver" in got["cmdline"]  # forked, never exec'd
        assert got["preloaded"] == ["shardtune.train.loop", "transformers"] and got["path0"] == str(tmp_path)
        # the inherited heap is frozen: a full collection does not walk the preloaded modules' objects
        assert got["frozen"] > 100_000, got["frozen"]
