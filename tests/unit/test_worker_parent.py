"""A worker's start (shardtune/stop.py `die_with_parent`): it stops when the launcher that marked its environment
is gone, and only then; a marked environment inherited from elsewhere does not stop it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

CHECK = "from shardtune.stop import die_with_parent; die_with_parent(); print('went on')"


def _worker_start(launcher_pid: int) -> subprocess.CompletedProcess:
    # A fresh process: die_with_parent also asks the kernel to kill it with its parent (prctl), not for this one.
    return subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
                               "SHARDTUNE_LAUNCHER_PID": str(launcher_pid)})


def test_a_worker_whose_launcher_is_gone_stops_with_one_line():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: no process has this pid now
    proc = _worker_start(gone.pid)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: the shardtune launcher (pid {gone.pid}) ended before this worker "
                                   "started; this worker stops")


def test_an_inherited_mark_of_a_live_process_is_not_a_lost_launcher():
    """The variable names a live process that is not the parent (pid 1 here; a test session or job script that
    ran a launcher in-process): the worker goes on, as `torchrun -m shardtune` from such a shell must."""
    proc = _worker_start(1)
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", proc.stderr
