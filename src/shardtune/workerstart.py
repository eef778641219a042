"""Opt-in, CPU only: start the workers from a forkserver that has already imported torch, transformers and the loop.

`SHARDTUNE_WORKER_START=forkserver` makes the launcher run torchrun's agent with a function entrypoint and
multiprocessing's forkserver instead of one `python -m shardtune` per rank. The forkserver imports the heavy modules
once (`PRELOAD`: ~6-8 CPU-s per process on a CPU machine) and forks every worker from there; a launcher that runs
many launches (the test session, whose `cli` fixture launches in-process) pays the imports once. Everything else is
the launcher's as it is at each launch, as Popen would give it: the environment, the working directory, stdout and
stderr (the launcher's descriptors, passed over the forkserver's socket), a session of its own, and exit codes.

The forkserver only imports: a process that has run an OpenMP-parallel op hangs in its forked children.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

WORKER_START_ENV = "SHARDTUNE_WORKER_START"
# shardtune.cli before transformers: it quiets the libraries' noise before they log it (runtime.quiet_library_noise).
PRELOAD = ["torch", "torch.distributed", "shardtune.cli", "transformers", "transformers.models.llama.modeling_llama",
           "shardtune.workerstart", "shardtune.train.loop"]
# The forkserver's environment when it imported this module: what a worker's rank variables are told apart from.
_BASELINE = dict(os.environ)
# The launch that forked this worker: called by clean_exit before it ends the process (see `_report_done`).
_before_exit: Any = None


def wanted() -> bool:
    """Whether this launch starts its workers from the forkserver: asked for, and no GPU (CUDA must not be
    initialised in a process that forks)."""
    if os.environ.get(WORKER_START_ENV, "") != "forkserver":
        return False
    import torch

    return not torch.cuda.is_available()


class _Fd:
    """A file descriptor of the launcher, handed to the worker over the forkserver's socket (SCM_RIGHTS): the same
    open file, offset and all, as a Popen'd worker inherits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def start_forkserver() -> int:
    """Start this process's forkserver with the preloads, unless it runs already; its pid."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def launch(parsed: Any) -> None:
    """torchrun.run(parsed) with the workers forked from the preloaded forkserver; raises as torchrun.run does."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if parsed.standalone:  # as torchrun.run does
        parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if parsed.master_port is None:
        parsed.master_port = 29500
    config, _cmd, cmd_args = config_from_args(parsed)
    # [-u, -m, shardtune, ARGS...] runs `shardtune ARGS`; [-u, SCRIPT.py, ARGS...] runs the script (a test's worker).
    if parsed.module:
        if parsed.training_script != "shardtune":
            raise ValueError(f"{WORKER_START_ENV}=forkserver runs `-m shardtune` or a script, "
                             f"not -m {parsed.training_script}")
        script, worker_argv = None, cmd_args[cmd_args.index("shardtune") + 1:]
    else:
        script, worker_argv = parsed.training_script, cmd_args[cmd_args.index(parsed.training_script) + 1:]
    config.start_method = "forkserver"
    server = start_forkserver()
    from multiprocessing import resource_tracker

    from shardtune import stop

    # SIGUSR1 forwarding: the workers are the forkserver's children; neither it nor the tracker may get the signal.
    stop.helpers[:] = [p for p in (server, resource_tracker._resource_tracker._pid) if p]  # type: ignore[attr-defined]
    try:
        elastic_launch(config, entrypoint=worker_main)(os.getcwd(), dict(os.environ), _Fd(1), _Fd(2), server,
                                                      script, worker_argv)
    finally:
        stop.helpers[:] = []


def worker_main(cwd: str, env: dict[str, str], out_fd: int, err_fd: int, server: int, script: str | None,
                argv: list[str]) -> None:
    """A worker forked from the forkserver: take on the launcher's state, then run `shardtune ARGV` as
    `python -m shardtune ARGV` would, or, given a script, `python SCRIPT ARGV`."""
    import gc

    # What the forkserver imported lives as long as this process: out of the collector's sight, a full pass (the
    # loop's one at the start of a run) walks only what the worker made, not the 300-500 thousand imported
    # objects (~0.4 s a pass on CI's CPU), and leaves the inherited pages unwritten (the Python docs' advice for
    # forked servers).
    gc.freeze()
    os.setsid()  # as torchrun's Popen: a terminal's Ctrl-C reaches the launcher, which forwards it
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]  # python -u
    sys.stderr.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    rank_env = {k: v for k, v in os.environ.items() if _BASELINE.get(k) != v}  # what torchrun's agent set
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(rank_env)
    from shardtune import stop

    os.environ[stop.LAUNCHER_PID] = str(server)  # the worker's parent, which dies with the launcher
    os.chdir(cwd)
    global _before_exit
    _before_exit = _report_done(sys._getframe())
    try:
        code = _run_cli(argv) if script is None else _run_script(script, argv)
    except KeyboardInterrupt:  # torch's _wrap would swallow it (exit 0); python -m shardtune ends 130 (cli._worker)
        code = 130
    except Exception:  # torch's _wrap would write the traceback to a file only; python -m shardtune prints it
        traceback.print_exc()
        code = 1
    if code:
        sys.stderr.flush()
        os._exit(code)


def _run_cli(argv: list[str]) -> int:
    sys.argv = [os.path.join(os.path.dirname(__file__), "__main__.py"), *argv]
    from shardtune.cli import main

    return main(argv)


def _run_script(path: str, args: list[str]) -> int:
    """`python PATH ARGS`: the script's folder first on sys.path, run as __main__; its exit code."""
    import runpy

    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else int(err.code is not None)
    return 0


def _report_done(frame: Any) -> Any:
    """The agent waits for every worker's return value before it calls the run done; a worker ends with os._exit
    (clean_exit), so it hands its value in first. The queue and event are those of torch's `_wrap` for this rank."""
    while frame is not None and "ret_val_" not in frame.f_locals:
        frame = frame.f_back
    if frame is None:
        raise RuntimeError("torch's elastic _wrap not found: this torch version does not fit "
                           f"{WORKER_START_ENV}=forkserver; unset it")
    queue, event = frame.f_locals["ret_val_"], frame.f_locals["queue_finished_reading_event"]

    def done(code: int) -> None:
        if code == 0:
            queue.put(None)
            event.wait()

    return done
