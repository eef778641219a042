"""StepSampler across processes (with the token cache built by local rank 0), and its resume state."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, torchrun

WORKER = str(ROOT / "tests" / "dist" / "sampler_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 processes x grad_accum 2 on a fresh cache, then 1 process x grad_accum 4 (same global batch)
    resuming from the 2-process run's saved state."""
    tmp = tmp_path_factory.mktemp("sampler")
    cache = tmp / "cache"
    torchrun(2, [WORKER, str(tmp), str(cache), "2"])
    two = json.loads((tmp / "results-2.json").read_text())
    (tmp / "state.json").write_text(json.dumps(two[0]["state"]))
    torchrun(1, [WORKER, str(tmp), str(cache), "4", str(tmp / "state.json")])
    one = json.loads((tmp / "results-1.json").read_text())
    return two, one


def _flat(mbs):
    return [i for mb in mbs for i in mb]


@pytest.mark.dist
def test_rank0_builds_the_cache_once_and_the_others_wait(runs):
    two, one = runs
    assert [r["hit"] for r in two] == [False, False]  # rank 0 built it, rank 1 polled until it was there
    assert one[0]["hit"]  # the next launch reads the cache
    assert two[0]["encoder_procs"] == 2  # built by 2 worker processes started from a torchrun rank
    n = two[0]["num_examples"]
    assert n == one[0]["num_examples"] == 230 - 10
    assert two[0]["bad_rows"] == {"marked bad": {"count": 10, "first": [f"rows.jsonl:{k}" for k in
                                                                        (23, 46, 69, 92, 115)]}}


@pytest.mark.dist
def test_epoch_covered_disjointly_and_same_global_batches_as_one_process(runs):
    two, one = runs
    n, spe = two[0]["num_examples"], two[0]["steps_per_epoch"]
    g = 2 * 2 * 2
    assert spe == one[0]["steps_per_epoch"] == n // g
    for epoch in (0, 1):
        seen = []
        for step in range(epoch * spe, (epoch + 1) * spe):
            r0, r1 = (_flat(r["steps"][step]) for r in two)
            assert len(r0) == len(r1) == g // 2 and not set(r0) & set(r1)  # disjoint within the step
            seen += r0 + r1
            ref = one[0]["steps"][step]  # one process, grad_accum 4: the same chunks, interleaved
            assert ref == [two[0]["steps"][step][0], two[1]["steps"][step][0],
                           two[0]["steps"][step][1], two[1]["steps"][step][1]]
        assert len(seen) == len(set(seen)) == spe * g and set(seen) <= set(range(n))  # disjoint over the epoch
    assert two[0]["steps"][0] != two[0]["steps"][spe]  # the next epoch is reshuffled
    # every rank read the same tokens for an example as the single process did
    merged = {**two[0]["checksums"], **two[1]["checksums"]}
    assert merged == one[0]["checksums"] and len(merged) == spe * g


@pytest.mark.dist
def test_state_dict_resumes_at_the_same_indices(runs):
    two, one = runs
    assert all(r["resumed_same"] for r in (*two, *one))
    state = two[0]["state"]
    assert state["position"] == 5 and state["num_examples"] == two[0]["num_examples"] and state["seed"] == 3
    # the 1-process run resumed the 2-process run's state (same global batch): same batches from step 5 on
    resumed = one[0]["from_other"]
    assert resumed["position"] == 5
    for k, mbs in enumerate(resumed["steps"]):
        step = 5 + k
        assert sorted(_flat(mbs)) == sorted(_flat(two[0]["steps"][step]) + _flat(two[1]["steps"][step]))


@pytest.mark.dist
def test_a_checkpoint_folder_not_every_node_sees_is_refused(tmp_path):
    """Two processes as two nodes (local world 1 each), real gloo and files: one folder for both passes and leaves
    no marker; a folder of each node's own is refused on every rank, naming the folder and the blind node's rank."""
    torchrun(2, [str(ROOT / "tests" / "dist" / "shared_root_worker.py"), str(tmp_path)])
    results = [json.loads((tmp_path / f"shared-{r}.json").read_text()) for r in (0, 1)]
    assert [r["shared"] for r in results] == ["ok", "ok"]
    assert results[0]["leftover"] == []
    for rank, r in enumerate(results):  # each rank names rank 0's folder, and its own where that differs
        assert "is not shared by every node: rank 1's node does not see the file rank 0 wrote" in r["per-node"]
        here = f" (this node's is {tmp_path / 'node1'})" if rank else ""
        assert f"checkpoint folder {tmp_path / 'node0'}{here} is not" in r["per-node"]
