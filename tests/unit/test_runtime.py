"""young_gc_only: no automatic full collection inside the block; young ones go on. collect_between_steps: no
automatic collection at all, the loop's own between steps, timed. quiet_library_noise: other libraries' records
that say nothing to act on are dropped, and nothing else of theirs."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import weakref

import pytest

from shardtune.runtime import collect_between_steps, quiet_library_noise, young_gc_only


class _Node:
    pass


def _generations_collected_while_allocating(n: int) -> tuple[set[int], list]:
    seen: set[int] = set()

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            seen.add(info["generation"])

    gc.callbacks.append(note)
    try:
        kept = [_Node() for _ in range(n)]  # long-lived: this sets off full passes by default
    finally:
        gc.callbacks.remove(note)
    return seen, kept


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14's incremental collector has no full passes")
def test_young_gc_only_stops_full_collections_and_keeps_young_ones():
    # A full pass starts once 10 middle passes ran (each after 10 young ones, each after 700 allocations: 70,000 in
    # all) and the survivors since the last exceed a quarter of the old generation: with a small heap (this module
    # run alone) twice the objects alive could fall short of the first.
    n = max(2 * len(gc.get_objects()), 300_000)
    seen, kept = _generations_collected_while_allocating(n)
    assert 2 in seen  # the default: a full pass over everything, as at a checkpoint save
    del kept
    before = gc.get_threshold()
    with young_gc_only():
        node = _Node()
        node.self = node
        ref = weakref.ref(node)
        del node
        seen, kept = _generations_collected_while_allocating(n)
        assert 2 not in seen and 0 in seen
        assert ref() is None  # a young cycle is still freed
        del kept
    assert gc.get_threshold() == before


def test_collect_between_steps_runs_only_the_loops_collections_and_frees_cycles():
    with collect_between_steps() as clock:
        node = _Node()
        node.self = node
        ref = weakref.ref(node)
        del node
        seen, kept = _generations_collected_while_allocating(2 * len(gc.get_objects()))
        assert seen == set() and clock.take() == 0.0  # none inside a step, however much it allocates
        assert ref() is not None  # the cycle waits for the step's end
        del kept
        clock.collect()
        assert ref() is None and clock.take() > 0.0  # freed there, and timed
    assert gc.isenabled() and clock not in gc.callbacks


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_library_noise_is_dropped_and_nothing_else():
    import torch

    quiet_library_noise()
    quiet_library_noise()  # once is enough; twice changes nothing
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    wrap = logging.getLogger("torch._higher_order_ops.wrap")
    kept = _Kept()  # on the loggers themselves: torch's do not propagate to the root
    for logger in (torchao, pytree, wrap):
        logger.addHandler(kept)
    try:
        torchao.warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                        "Could not load this library")
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version.")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
                       "type. Calling register_constant() on Enum subclasses is deprecated.", "<enum 'Kernel'>")
        pytree.warning("another pytree warning")
        wrap.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\nPlease make "
                     "sure the checkpointed region does not contain in-place ops (e.g. torch.relu_).\n")
        wrap.warning("another wrap warning")
    finally:
        for logger in (torchao, pytree, wrap):
            logger.removeHandler(kept)
    cuda_kernels_kept = torch.version.cuda is not None  # where a CUDA kernel's failed load means something
    assert any("Failed to load" in m for m in kept.messages) == cuda_kernels_kept
    assert "Skipping import of cpp extensions due to incompatible torch version." in kept.messages
    assert not any("Enum subclass" in m for m in kept.messages) and "another pytree warning" in kept.messages
    assert not any("context_fn" in m for m in kept.messages) and "another wrap warning" in kept.messages
    assert len(torchao.filters) == len(pytree.filters) == len(wrap.filters) == 1


def test_a_command_imports_transformers_models_without_the_noise():
    """What a run's first lines were on a CPU machine with torchao installed (transformers imports it with its
    first model class): a fresh interpreter that imports the CLI, then a model class."""
    code = ("import shardtune.cli, transformers\n"
            "from transformers import LlamaForCausalLM\n"
            "import torchao\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Enum subclass" not in proc.stderr
    import torch

    if torch.version.cuda is None:
        assert "Failed to load" not in proc.stderr
