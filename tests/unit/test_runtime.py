"""young_gc_only: no automatic full collection inside the block; young ones go on. collect_between_steps: no
automatic collection at all, the loop's own between steps, timed."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

from shardtune.runtime import collect_between_steps, young_gc_only


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
    n = 2 * len(gc.get_objects())
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
