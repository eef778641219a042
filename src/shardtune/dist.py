"""Process-group set-up and the clean worker exit."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from shardtune.errors import error_chain


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class HostCopy:
    """Device scalars copied to host memory behind the kernels queued so far; `values()` waits for that copy only.

    `float(t)` on a GPU tensor queues its copy behind everything on the stream, so read after an optimizer step
    is queued it waits for the step, and the GPU then idles while the host prepares the next one. Copied (into
    pinned memory) before the step is queued and read after, the host waits only for the work before the copy,
    and the optimizer's kernels keep the GPU busy while the host goes on. On a CPU: the values as they are."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        flat = torch.stack([t.detach().float().reshape(()) for t in tensors])
        self._event: torch.cuda.Event | None = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def device_type() -> str:
    """"cuda" on a machine with a GPU, else "cpu": the device every process of a run here trains on."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> DistContext:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU); a lone process forms a group of 1."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


# What a collective says when a process of another node died (gloo, NCCL, the TCP store); matched in the error and
# the errors it was raised from.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "Broken pipe",
              "NCCL communicator was aborted", "Watchdog caught collective operation timeout", "DistNetworkError")


def lost_peer(err: BaseException) -> str | None:
    """The line of `err` (or of an error it came from) that says another process of the run is gone, else None."""
    for e in error_chain(err):
        for line in f"{type(e).__name__}: {e}".splitlines():
            if any(marker in line for marker in _LOST_PEER):
                return line.strip()[:300]
    return None


def first_problem(problem: str | None) -> str | None:
    """Collective (and a barrier): the first rank's `problem` (a one-line message, or None) on every rank, so that
    a failure one rank met (its disk filled up) stops every rank at the same point, none left waiting in a
    collective the failed one never joins."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problem
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p), None)


def all_gather_single(output: torch.Tensor, part: torch.Tensor) -> Any:
    """`output` = every rank's `part` in rank order (torch 2.13 renamed all_gather_into_tensor, now deprecated)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, part)


def reduce_scatter_single(part: torch.Tensor, full: torch.Tensor) -> Any:
    """`part` = this rank's piece of the sum of every rank's `full` (torch 2.13 renamed reduce_scatter_tensor)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(part, full)


def all_gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Each rank's `values`, in rank order, on every rank (one collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [t.tolist()]
    world = dist.get_world_size()
    out = torch.empty(world * len(values), dtype=torch.float64, device=device)  # flat: gloo wants 1-D pieces
    all_gather_single(out, t)
    return out.view(world, len(values)).tolist()


def clean_exit(code: int) -> NoReturn:
    """End a worker without the gloo abort at interpreter shutdown (pytorch/pytorch#179291).

    gloo's background thread can release a Python object while the interpreter tears down and
    SIGABRT a run whose work is done; a barrier, destroy and os._exit skip that teardown.
    """
    if dist.is_initialized():
        try:
            if code in (0, 130, 143):  # an orderly end (143, 130: stopped at a signal, with a checkpoint)
                dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    from shardtune import workerstart

    if workerstart._before_exit is not None:  # forked by the forkserver: the agent waits for this first
        workerstart._before_exit(code)
    os._exit(code)


def shard_mesh_dim(t: torch.Tensor) -> int:
    """The mesh dimension a sharded DTensor's rows are split over: 0 under FSDP2 ((Shard(0),)), the
    shard dimension under HSDP ((Replicate(), Shard(0))). Every other dimension must replicate."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(t.placements) if not isinstance(pl, Replicate)]
    if len(dims) != 1 or not isinstance(t.placements[dims[0]], Shard) or t.placements[dims[0]].dim != 0:
        raise AssertionError(f"expected rows sharded on one mesh dimension, got {t.placements}")
    return dims[0]
