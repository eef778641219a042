"""The collective counter on a real one-process gloo group: what it counts, the ring convention, and that the
process group works as before once the counter is removed (its methods are put back as they were)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune.metrics.comm import CommCounter, bus_factor, counting, per_step


@pytest.fixture
def group(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _collectives() -> None:
    gathered = torch.zeros(8)
    dist.all_gather_into_tensor(gathered, torch.ones(8))  # the deprecated alias: counted once, as all_gather
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))


def test_counts_each_collective_once_by_kind_and_restores_the_group(group):
    for _ in range(2):  # installed, removed, installed again: the second time counts the same
        with counting(CommCounter()) as counter:
            _collectives()
            totals = counter.take()
            assert totals == {"all_gather": {"calls": 1, "bytes": 32.0, "bus_bytes": 0.0},
                              "all_reduce": {"calls": 1, "bytes": 24.0, "bus_bytes": 0.0},
                              "reduce_scatter": {"calls": 1, "bytes": 8.0, "bus_bytes": 0.0}}
            assert counter.take() == {}  # take() starts again from zero
        _collectives()  # uncounted, and the restored methods still bind the group


def test_ring_bus_factors_and_metrics_fields():
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("broadcast", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    assert per_step({"all_gather": {"calls": 4, "bytes": 80.0, "bus_bytes": 40.0}}, 2) == {
        "comm_all_gather_bytes": 20.0, "comm_all_gather_calls": 2.0}
