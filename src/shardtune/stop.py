"""Signals: stop cleanly when a scheduler asks, save on request, and never outlive the launcher.

Worker side: SIGTERM or SIGINT (what Slurm, Kubernetes and Ctrl-C send before a preemption) only set a flag;
the training loop finishes the step, and all ranks agree at its end (`agree`) to write a checkpoint there and exit
with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT). A second SIGINT exits at once. SIGUSR1 asks for
a checkpoint at the end of the step, and training goes on. A worker dies with its launcher (`die_with_parent`).

Launcher side: torchrun's agent forwards SIGTERM and SIGINT to the workers and waits for them
(`graceful_shutdown_seconds`); `forward_to_children` forwards SIGUSR1, which torchrun does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAVE_SIGNAL = signal.SIGUSR1
# How long the launcher waits for the workers to finish their step and write the checkpoint after forwarding a
# stop signal, before it kills them (torchrun's default is 30 s, too short to save a large model). A scheduler's
# own grace period (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds) ends it earlier in any case.
graceful_shutdown_seconds = 1800


@dataclass
class _Flags:
    stop: int = 0  # the number of the first stop signal received, 0 for none
    save: bool = False  # SIGUSR1 received since the last checkpoint it asked for


_flags = _Flags()
_installed: dict[int, Any] = {}


def _on_stop(signum: int, frame: FrameType | None) -> None:
    if _flags.stop and signum == signal.SIGINT:
        # The second Ctrl-C: the user does not want to wait for the step and the checkpoint.
        os.write(2, b"interrupted again: stopping now, without a checkpoint; --resume auto continues from the "
                    b"last complete one\n")
        os._exit(128 + signum)
    _flags.stop = _flags.stop or signum


def _on_save(signum: int, frame: FrameType | None) -> None:
    _flags.save = True


def install() -> None:
    """Catch the stop and save signals in this process (main thread only; elsewhere Python cannot)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        _installed.setdefault(sig, signal.signal(sig, _on_stop))
    _installed.setdefault(SAVE_SIGNAL, signal.signal(SAVE_SIGNAL, _on_save))


def requested() -> int:
    """The first stop signal this process received (0: none), e.g. torchrun's agent ending it."""
    return _flags.stop


def uninstall() -> None:
    """Restore the handlers `install` replaced, and forget the flags."""
    for sig, old in _installed.items():
        signal.signal(sig, old)
    _installed.clear()
    _flags.stop, _flags.save = 0, False


@dataclass(frozen=True)
class Request:
    stop: int  # a stop signal's number (the largest any rank received), 0 to go on
    save: bool  # some rank asked for a checkpoint (SIGUSR1)


def agree(device: Any) -> Request:
    """What the ranks do after this step, agreed by all of them: each rank's flags reduced with MAX.

    Called at the end of every optimizer step. Cost: one all_reduce of two numbers (latency only: tens of
    microseconds over NCCL in a node, ~0.1 ms over gloo) and one host sync, which on a GPU waits for the step's
    kernels before the next step's are queued; the tiny CPU run in the tests did not change speed measurably.
    A signal seen by one rank alone (a scheduler may signal only some processes) still stops every rank at the
    same step, so their checkpoint is consistent.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([float(_flags.stop), float(_flags.save)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stop, save = (int(v) for v in t.tolist())
    else:
        stop, save = _flags.stop, int(_flags.save)
    _flags.save = False
    return Request(stop, bool(save))


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# ---- the launcher and its workers ---------------------------------------------------------------------------

LAUNCHER_PID = "SHARDTUNE_LAUNCHER_PID"
# The launcher's helper processes (the forkserver and multiprocessing's resource tracker, shardtune/workerstart.py):
# not workers, and the forkserver's children are.
helpers: list[int] = []
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this worker when its parent (the launcher running torchrun's agent) dies, even by
    kill -9, so no orphan keeps training and writing into the run directory. Linux only (prctl); elsewhere a
    no-op. If the launcher is already gone (it died before this ran), exit now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    launcher = os.environ.get(LAUNCHER_PID)
    # Not our parent is not enough: the variable is inherited, so a `torchrun -m shardtune` started from a process
    # that a launcher marked (a test session, a job script) names a process that is alive and not its launcher.
    if launcher and os.getppid() != int(launcher) and not alive(int(launcher)):
        print(f"error: the shardtune launcher (pid {launcher}) ended before this worker started; this worker stops",
              file=sys.stderr, flush=True)
        os._exit(1)


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> list[int]:
    """The direct child processes of `pid` (from /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(d.name))
    return found


def forward_to_children(signum: int, frame: FrameType | None = None) -> None:
    """A launcher's handler: pass the signal on to every worker (torchrun forwards only stop signals)."""
    for pid in [p for parent in (os.getpid(), *helpers) for p in children(parent) if p not in helpers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
