"""Communication accounting: the bytes of every collective the run issues, counted where each one enters its
process group, with no synchronisation and no change to what is sent.

Every torch.distributed entry point (`all_gather_single`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
`all_reduce`, the coalesced forms, DeepSpeed's `deepspeed.comm`, DDP's comm hook) ends in one method call on a
`ProcessGroup` object; wrapping those methods of the class sees FSDP2's and DeepSpeed's collectives alike,
whichever Python function they came through, and counts each exactly once. Counting reads tensor sizes only
(metadata on the host): ~3 us per collective on a 2-core CPU (bench/probe_comm_counter.py). Collectives issued
from C++ without Python (DTensor's functional collectives: the grad-norm scalar, `full_tensor` at save time) are
not seen; they are scalars during a step.

Bytes are reported two ways:
- `bytes`: the collective's buffer (the gathered output of an all-gather, the input of a reduce-scatter, the
  tensor of an all-reduce);
- `bus_bytes`: what each rank puts on the wire with ring algorithms (NCCL's bus-bandwidth convention, and the
  planner's `comm_bytes`): an all-gather / reduce-scatter / all-to-all of B bytes over n ranks moves B(n-1)/n,
  an all-reduce 2B(n-1)/n, a broadcast or reduce B.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# ProcessGroup method -> collective kind. The buffer of an all-gather / reduce-scatter is the larger of its two
# tensor arguments (the gathered output, the input to scatter); of the others, the first argument.
KINDS = {
    "all_gather_single": "all_gather", "allgather": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single_coalesced": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_single_coalesced": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "reduce": "reduce", "broadcast": "broadcast",
    "all_to_all_single": "all_to_all", "alltoall_base": "all_to_all", "alltoall": "all_to_all",
}
TWO_SIDED = ("all_gather", "reduce_scatter")


def bus_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of the collective's buffer, ring algorithms over n ranks."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce", "broadcast"):
        return 1.0
    return (n - 1) / n


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter:
    """Per-kind totals since the last `take()`: calls, bytes, bus_bytes. One counter is installed at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a DeepSpeed or DCP helper thread may issue collectives too
        self._totals: dict[str, list[float]] = {}

    def add(self, kind: str, nbytes: int, n: int) -> None:
        with self._lock:
            t = self._totals.setdefault(kind, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += nbytes
            t[2] += nbytes * bus_factor(kind, n)

    def take(self) -> dict[str, dict[str, float]]:
        """The totals by kind since the last take, and start again from zero."""
        with self._lock:
            totals, self._totals = self._totals, {}
        return {k: {"calls": int(c), "bytes": b, "bus_bytes": bus} for k, (c, b, bus) in totals.items()}


_ACTIVE: list[CommCounter] = []  # the installed counter (a list: no `global` statement)
_ORIGINAL: dict[str, Any] = {}


def _wrap(name: str, kind: str, original: Any) -> Any:
    two_sided = kind in TWO_SIDED

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE and args:
            nbytes = max(_nbytes(args[0]), _nbytes(args[1]) if len(args) > 1 else 0) if two_sided \
                else _nbytes(args[0])
            _ACTIVE[0].add(kind, nbytes, self.size())
        return original(self, *args, **kwargs)

    counted.__name__ = counted.__qualname__ = name
    counted.__doc__ = original.__doc__
    return counted


@contextlib.contextmanager
def counting(counter: CommCounter) -> Iterator[CommCounter]:
    """Count every collective on any process group into `counter` while the block runs."""
    if _ACTIVE:
        raise RuntimeError("a CommCounter is already installed")
    pg = dist.ProcessGroup
    for name, kind in KINDS.items():
        # Keep the class's own descriptor to put back: getattr(pg, name) is the plain builtin function, which
        # set back on the class would no longer bind `self`.
        raw = vars(pg).get(name)
        if raw is not None:
            _ORIGINAL[name] = raw
            setattr(pg, name, _wrap(name, kind, getattr(pg, name)))
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.clear()
        for name, original in _ORIGINAL.items():
            setattr(pg, name, original)
        _ORIGINAL.clear()


def per_step(totals: dict[str, dict[str, float]], steps: int) -> dict[str, float]:
    """metrics.jsonl's flat fields for an interval of `steps` steps: comm_<kind>_bytes (bus bytes per rank per
    step, the planner's unit) and comm_<kind>_calls (per step)."""
    out: dict[str, float] = {}
    for kind, t in sorted(totals.items()):
        out[f"comm_{kind}_bytes"] = t["bus_bytes"] / steps
        out[f"comm_{kind}_calls"] = t["calls"] / steps
    return out


def current() -> CommCounter | None:
    """The installed counter, if any (the loop's, while a run trains)."""
    return _ACTIVE[0] if _ACTIVE else None


def merge(into: dict[str, dict[str, float]], totals: dict[str, dict[str, float]]) -> None:
    for kind, t in totals.items():
        acc = into.setdefault(kind, {"calls": 0, "bytes": 0.0, "bus_bytes": 0.0})
        for key, value in t.items():
            acc[key] += value
