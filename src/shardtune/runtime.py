"""Process-wide settings for long-running commands."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
import warnings
from collections.abc import Iterator

_NEVER = 1 << 30  # a full-collection threshold no count reaches


class GcClock:
    """The seconds the collector ran (every thread stopped) since the last `take()`, through gc.callbacks: the
    loop's records carry it, so a step slowed by a collection says so."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def collect(self) -> None:
        """The young generations' collection the loop runs between steps (collect_between_steps)."""
        gc.collect(1)


@contextlib.contextmanager
def collect_between_steps() -> Iterator[GcClock]:
    """No automatic garbage collection inside the block: the training loop calls the clock's `collect()` after
    each step instead (young generations only), as torchtitan's gc_freq does every 50 steps. Automatic young
    collections ran some 20 times inside each step, every one walking the step's live Python objects: 3-4 ms a
    step of 8B LoRA on one H100 (~1% of a 330 ms float8 step whose pace the host sets; bench/RESULTS.md,
    twenty-fifth session). Between steps most of those objects are gone, and what a step leaves in cycles is
    still freed one step later, as before. Full passes are off here too (young_gc_only says why)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        yield clock
    finally:
        gc.callbacks.remove(clock)
        if enabled:
            gc.enable()


@contextlib.contextmanager
def young_gc_only() -> Iterator[None]:
    """No automatic full garbage collection inside the block; young collections go on as usual.

    A training or export process holds 300-500 thousand long-lived objects (imported code, modules,
    the tokenizer) and a full pass walks them all: 0.2-0.35 s with every thread stopped. On an H200
    (1B model, zero3) full passes ran at every checkpoint save, inside a training step, and 15-29
    times in a 1B export. With no collection at all in the loop, an async save cost the run what its
    staging took, and the export took 17.5 s instead of 21-23 s (bench/RESULTS.md, 2026-12-01, fourth
    session); torchtitan turns the collector off in its loop for the same stalls. Young collections
    (milliseconds; they ran in every one of those runs) go on freeing the cyclic objects each step
    leaves (some 930 a step for the tiny model on CPU); what survives into the old generation waits
    for the block's end (tiny model on CPU, 1,000 steps with an async save every 20: the old
    generation grew by ~25 objects a save, and not at all without saves). Python 3.14's incremental
    collector makes no full passes; there the old generation's threshold is ignored."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


# Log records of other libraries that tell a shardtune user nothing to act on, by logger. transformers imports
# torchao wherever it is installed (its quantizer module, at the first model class), so with the `float8` / `qlora`
# extras every run printed these before its first line:
# - torchao's wheel carries CUDA kernels (_C_mxfp8, _C_cutlass_90a) that a CPU build of torch cannot load: one
#   "Failed to load ...so" per file and process. Kept where torch has CUDA, where a failed load means something.
# - torch (2.13) tells torchao (0.18) that registering its Enums as pytree constants is deprecated.
# Each is a logging filter: a callable that returns whether to keep the record.
def _not_torchao_cuda_kernels_without_cuda(record: logging.LogRecord) -> bool:
    torch = sys.modules.get("torch")
    message = record.getMessage()
    return not (torch is not None and torch.version.cuda is None and message.startswith("Failed to load ")
                and "torchao" in message and ".so" in message)


def _not_torch_enum_constant_deprecation(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()


def _not_checkpoint_context_fn_notice(record: logging.LogRecord) -> bool:
    # - torch, once a process, where compile traces a checkpoint given a context_fn (parallel/prepare.py's
    #   recompute_all_context and selective policy: every compiled block under checkpointing, the GPU default):
    #   "make sure the checkpointed region does not contain in-place ops". A note to the code's author, which
    #   tests/dist/test_parity.py's compiled checkpoint variants answer, not to its user.
    return "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


_LIBRARY_NOISE = {"torchao": _not_torchao_cuda_kernels_without_cuda,
                  "torch.utils._pytree": _not_torch_enum_constant_deprecation,
                  "torch._higher_order_ops.wrap": _not_checkpoint_context_fn_notice}
# Python warnings of the same kind, by category and the start of the message (a regex):
# - transformers (5.2x) tells PEFT (0.21), whose get_peft_model reads `is_gradient_checkpointing`, that it is
#   deprecated: a line in every LoRA / QLoRA run.
# - torch (2.13) tells DeepSpeed (0.19) that all_gather_into_tensor and reduce_scatter_tensor are deprecated, at each
#   call (shardtune calls the new names: dist.all_gather_single).
_LIBRARY_WARNINGS = [
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
]


def quiet_library_noise() -> None:
    """Drop the log records in _LIBRARY_NOISE (once per process; before the libraries are imported, since torchao
    logs while it is imported)."""
    for name, keep in _LIBRARY_NOISE.items():
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)
    for category, message in _LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)  # a repeat replaces, not adds
