"""The suite's own subprocess helper (tests/conftest.py): a timeout ends the whole process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import run

# Starts a grandchild in a session of its own (as torchrun starts its workers), writes its pid, and outlives any
# test timeout.
TREE = ("import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "time.sleep(120)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child whose parent is gone may linger as a zombie until init reaps it
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_timeout_kills_the_grandchildren_too(tmp_path):
    pid_file = tmp_path / "pid"
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", TREE, str(pid_file)], timeout=5)
    assert time.time() - start < 60  # not held until the grandchild's own end
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
