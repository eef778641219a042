from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".pytest_cache" / "inductor"))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(cmd: list[str], timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, returning its completed process (stdout and stderr as text)."""
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


def torchrun(nproc: int, script_and_args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Launch a script on `nproc` gloo processes with torchrun; fail the test with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *script_and_args]
    proc = run(cmd, timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


def shardtune(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real console entry point, as a user runs it."""
    return run([sys.executable, "-m", "shardtune", *args], timeout)


def max_diff(a: list[float], b: list[float], min_len: int = 6) -> float:
    """Largest difference of two loss trajectories of the same length (at least min_len steps)."""
    assert len(a) == len(b) >= min_len
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
