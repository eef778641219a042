"""Start the workers: re-execute `shardtune train` under torchrun unless already there."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchOptions:
    nproc: int | str | None = None  # flag value; None = take the config's parallel.nproc
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "shardtune"
    rdzv_timeout: int | None = None  # seconds to wait for every node (and to reach the endpoint); None: torchrun's


def under_torchrun() -> bool:
    """True inside a process that torchrun (or another elastic launcher) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


# Device files a GPU driver makes (NVIDIA; AMD ROCm; WSL's GPU bridge). Without any of them torch finds no GPU, so
# the answer needs no torch import (~3.5 s here, ~14 s on a cold GPU node: most of a `shardtune plan`).
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
_SMI_QUERY = "index,uuid,name,memory.total,memory.reserved,mig.mode.current"


@dataclass(frozen=True)
class LocalGpu:
    name: str
    memory_bytes: int


def gpu_driver_present() -> bool:
    """False when no GPU driver's device file exists here (then there is no GPU for torch to find)."""
    return any(os.path.exists(path) for path in _GPU_DEVICE_FILES)


def local_gpus() -> list[LocalGpu]:
    """The GPUs this process may use, in CUDA's order: from nvidia-smi where that answers for certain (no torch
    import), else from torch (already imported in a worker; AMD, MIG slices, mixed GPU types, no nvidia-smi)."""
    if not gpu_driver_present():
        return []
    if "torch" not in sys.modules:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        try:
            out = subprocess.run([smi, f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader,nounits"], check=True,
                                 capture_output=True, text=True, timeout=20).stdout if smi else None
        except (OSError, subprocess.SubprocessError):
            out = None
        gpus = visible_from_smi(out, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                os.environ.get("CUDA_DEVICE_ORDER")) if out is not None else None
        if gpus is not None:
            return gpus
    import torch

    if not torch.cuda.is_available():
        return []
    return [LocalGpu(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def visible_from_smi(csv: str, visible: str | None, order: str | None) -> list[LocalGpu] | None:
    """The GPUs CUDA would show, from nvidia-smi's `index, uuid, name, memory.total, memory.reserved [MiB],
    mig.mode.current` rows and CUDA_VISIBLE_DEVICES (indices or UUIDs; CUDA stops at the first it cannot match).
    Memory is total less what the driver reserves: CUDA's total (H200: 143,771 - 616 MiB, within 1 MiB of
    torch's 150,109,880,320 bytes). None where only CUDA can say: MIG on (nvidia-smi gives the whole GPU), or
    mixed GPU types under CUDA's default fastest-first order, which nvidia-smi's PCI order need not match."""
    rows = []
    for line in csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6 or not (parts[0].isdigit() and parts[3].isdigit() and parts[4].isdigit()):
            return None
        if parts[5].lower() == "enabled":
            return None
        rows.append((int(parts[0]), parts[1], parts[2], (int(parts[3]) - int(parts[4])) * 2**20))
    if len({(name, mem) for _, _, name, mem in rows}) > 1 and order != "PCI_BUS_ID":
        return None
    chosen = rows
    if visible is not None:
        chosen = []
        for token in (t.strip() for t in visible.split(",")):
            if token.startswith("MIG-"):
                return None  # a MIG slice: its memory is CUDA's to say
            match = [r for r in rows if (token.isdigit() and r[0] == int(token))
                     or (token.startswith("GPU-") and r[1].startswith(token))]
            if len(match) != 1 or match[0] in chosen:
                break
            chosen.append(match[0])
    return [LocalGpu(name, mem) for _, _, name, mem in chosen]


def local_gpu_count() -> int:
    return len(local_gpus())


def resolve_nproc(flag: int | str | None, config_value: int | str) -> int:
    """Processes on this node: the --nproc flag, else parallel.nproc; 'auto' = every local GPU, or 1 on CPU."""
    value = flag if flag is not None else config_value
    if value == "auto":
        return local_gpu_count() or 1
    return int(value)


def torchrun_args(nproc: int, worker_args: list[str], opts: LaunchOptions) -> list[str]:
    """torchrun's arguments for running `python -m shardtune <worker_args>` on every process."""
    cmd = [f"--nproc-per-node={nproc}"]
    if opts.nnodes == 1 and opts.rdzv_endpoint is None:
        cmd.append("--standalone")  # a private rendezvous on a free port: runs side by side do not clash
    else:
        cmd += [f"--nnodes={opts.nnodes}", "--rdzv-backend=c10d", f"--rdzv-id={opts.rdzv_id}"]
        if opts.rdzv_endpoint:
            cmd.append(f"--rdzv-endpoint={opts.rdzv_endpoint}")
        if opts.node_rank is not None:
            cmd.append(f"--node-rank={opts.node_rank}")
        if opts.rdzv_timeout is not None:
            cmd.append(f"--rdzv-conf=join_timeout={opts.rdzv_timeout},read_timeout={opts.rdzv_timeout}")
    return [*cmd, "-m", "shardtune", *worker_args]


DEFAULT_RDZV_TIMEOUT_S = 600  # torchrun's own join timeout


def wait_for_endpoint(endpoint: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at HOST:PORT within `timeout_s` (tried about once a second).

    A node other than the first probes the rendezvous before starting torchrun: torchrun's store client, when it
    cannot connect, retries with a C++ backtrace per try on stderr and then raises."""
    import socket
    import time

    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(1.0)


KILLED_EXIT = 128 + 9  # a worker died of SIGKILL: what a shell or scheduler reports for a process killed so


def run_torchrun(args: list[str], nproc: int, host_fixes: list[str] | None = None) -> int:
    """Run torchrun in this process and turn worker failures into an exit code.

    Running the elastic launcher in-process (as accelerate does) lets a worker's one-line user
    error stand alone: torchrun's ChildFailedError report would otherwise add a traceback to it.
    Workers exit 2 for bad input, 1 for anything else, 128 + N after stopping at signal N with a checkpoint
    (shardtune/stop.py): 143 for SIGTERM, 130 for SIGINT. The launcher's exit code is theirs, but for a worker
    killed by SIGKILL (the kernel's out-of-memory killer, as a rule): 137 and one line with `host_fixes`.
    """
    import signal

    from shardtune import stop

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no downloads at run time, ever
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # torchrun would set 1 thread per process (and print a banner about it); share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # A stop signal is forwarded by torchrun's agent, which then waits this long for the checkpoint.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(stop.graceful_shutdown_seconds))
    os.environ[stop.LAUNCHER_PID] = str(os.getpid())  # a worker whose parent is another has lost its launcher
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torchrun warns that c10d ignores --node-rank; shardtune passes it on for the record (and uses it itself).
    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    previous = signal.signal(stop.SAVE_SIGNAL, stop.forward_to_children)
    from shardtune import workerstart

    try:
        if workerstart.wanted():
            workerstart.launch(torchrun.parse_args(args))
        else:
            torchrun.run(torchrun.parse_args(args))
    except SignalException as err:
        # torchrun forwarded the signal and waited for the workers, which saved and said how to resume. A second
        # one while it waited (raised during the first's handling) killed them: they die with this process.
        if isinstance(err.__context__, SignalException):
            print(f"error: {err.sigval.name} again: stopped without waiting for the checkpoint; --resume auto "
                  "continues from the last complete one", file=sys.stderr)
        return 128 + int(err.sigval)
    except RendezvousError as err:
        # No traceback: the nodes did not meet (one never started, a wrong endpoint or id, a firewall).
        conf = next((a for a in args if a.startswith("--rdzv-conf=")), "")
        endpoint = next((a.split("=", 1)[1] for a in args if a.startswith("--rdzv-endpoint=")), "?")
        within = f" within {conf.split('join_timeout=')[1].split(',')[0]} s" if "join_timeout=" in conf else ""
        print(f"error: rendezvous at {endpoint} failed{within} ({type(err).__name__}): start every node with the "
              "same --nnodes, --rdzv-endpoint and --rdzv-id, and check that each reaches that host and port",
              file=sys.stderr)
        return 2
    except ChildFailedError as err:
        killed = sorted(rank for rank, failure in err.failures.items() if failure.exitcode == -signal.SIGKILL)
        if killed:  # before the others' lines: a worker that lost its peer says only that (and exits 2)
            print(f"error: worker process {killed[0]} was killed by SIGKILL, most likely by the kernel's out-of-memory "
                  "killer (host memory, not GPU memory; `dmesg | grep -i killed` or `journalctl -k` shows it); "
                  f"lower the host memory: {'; or '.join(host_fixes or ['fewer processes on this node (--nproc)'])}; "
                  "--resume auto continues from the newest complete checkpoint", file=sys.stderr)
            return KILLED_EXIT
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        if 2 in codes:
            return 2  # the worker printed the one-line error
        stopped = set(codes) & {128 + int(s) for s in stop.STOP_SIGNALS}
        if stopped and set(codes) <= stopped | {0}:
            return max(stopped)  # the workers themselves were signalled (Slurm signals every process) and saved
        print(f"error: worker process failed (exit code {', '.join(map(str, codes))}); see its output above",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(stop.SAVE_SIGNAL, previous)
    return 0
