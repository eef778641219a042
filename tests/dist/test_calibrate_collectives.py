"""`shardtune calibrate`'s collectives: torchrun workers (gloo on a CPU), and the time limit that stops them."""

from __future__ import annotations

import time

import pytest

from shardtune.plan.calibrate import Sizes, run_collectives

pytestmark = pytest.mark.dist


def test_collectives_on_two_processes():
    rates = run_collectives(2, Sizes(collective_bytes=2**20, collective_iters=3, warmup_s=0.0))
    assert rates["world"] == 2 and rates["backend"] == "gloo"
    assert rates["all_gather"] > 0 and rates["reduce_scatter"] > 0


def test_collectives_past_the_time_limit_are_stopped():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="timed out after 1 s"):
        run_collectives(2, Sizes(collective_timeout_s=1.0))  # torchrun alone takes longer to start
    assert time.perf_counter() - t0 < 15
