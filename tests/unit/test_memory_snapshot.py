"""log.memory_snapshot: the key and its refusals, and the text summary read from an allocator history.

PyTorch records the CUDA allocator only (`torch.cuda.memory._record_memory_history`), so the recording itself runs on
the GPU machine (bench/RESULTS.md); here the summary is computed from a history in the format
`torch.cuda.memory._snapshot()` returns (device_traces of alloc / free_requested events with their frames)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, one_line_error

from shardtune.config import load_config
from shardtune.errors import ConfigError
from shardtune.metrics.memory_snapshot import peak_allocations, summary_text

TINY = str(ROOT / "examples" / "tiny.yaml")
MIB = 2**20


def test_the_key_takes_two_steps() -> None:
    assert load_config(TINY, ["log.memory_snapshot=[3,4]"]).log.memory_snapshot == [3, 4]
    assert load_config(TINY, []).log.memory_snapshot is None
    for bad in ("[4,3]", "[0,2]", "[3]", "[1,2,3]"):
        with pytest.raises(ConfigError, match=r"log\.memory_snapshot: give two optimizer steps"):
            load_config(TINY, [f"log.memory_snapshot={bad}"])


def test_validate_refuses_it_on_a_cpu_in_one_line(cli) -> None:
    one_line_error(cli("validate", TINY, "log.memory_snapshot=[1,2]"), "log.memory_snapshot:",
                   "CUDA allocator", "cpu")


def test_compiled_blocks_under_checkpointing_are_refused_on_a_gpu_from_torch_2_11() -> None:
    """PyTorch 2.11's allocator history breaks the recompute of compiled blocks (pytorch/pytorch#179536; both
    8B runs that recorded with compile and full checkpointing crashed on one H200): refused before launch."""
    import torch
    from packaging.version import Version

    from shardtune.errors import ShardtuneError
    from shardtune.plan import snapshot_breaks_recompute
    from shardtune.validate import check_memory_snapshot

    assert Version(torch.__version__).release >= (2, 11)  # what CI and the GPU machine run
    recorded = ["log.memory_snapshot=[3,3]", "parallel.compile=true"]
    for ac in ("full", "selective"):
        with pytest.raises(ShardtuneError, match=r"^log\.memory_snapshot: PyTorch .*\(pytorch/pytorch#179536"):
            check_memory_snapshot(load_config(TINY, [*recorded, f"parallel.activation_checkpointing={ac}"]), "cuda")
    check_memory_snapshot(load_config(TINY, recorded), "cuda")  # compiled, no checkpointing: records
    assert snapshot_breaks_recompute([3, 3], "full") and not snapshot_breaks_recompute(None, "full")
    check_memory_snapshot(load_config(TINY, ["log.memory_snapshot=[3,3]", "parallel.activation_checkpointing=full"]),
                          "cuda")


def _alloc(addr: int, mib: int, where: str) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MIB,
            # as CUDA records them: the allocator's C++ frames first, then torch's Python, then the caller's
            "frames": [{"filename": "memory_snapshot.cpp", "line": 0, "name": "gather_with_cpp()"},
                       {"filename": "??", "line": 0, "name": "at::native::empty_cuda"},
                       {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                       {"filename": f"/src/{where}.py", "line": 7, "name": where}]}


def _free(addr: int, mib: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}


def test_the_peak_is_found_by_replaying_allocs_and_frees() -> None:
    """Logits (300 MiB) freed before the gradients (200 MiB) come: the peak is activations + logits, not the
    sum of everything ever allocated; a free_completed after free_requested is not counted twice."""
    trace = [_alloc(1, 60, "attention"), _alloc(5, 40, "attention"), _alloc(2, 300, "logits"), _free(2, 300),
             {"action": "free_completed", "addr": 2, "size": 300 * MIB}, _alloc(3, 200, "grads"), _free(1, 60),
             _free(5, 40), _alloc(4, 50, "optimizer")]
    peak, live = peak_allocations({"device_traces": [trace]}, baseline=1000 * MIB)
    assert peak == (1000 + 400) * MIB
    assert [e["addr"] for e in live] == [2, 1, 5]  # alive at the peak, largest first
    text = summary_text({"device_traces": [trace]}, 1000 * MIB, "steps 3-4")
    assert text.startswith("CUDA memory, steps 3-4: peak 1.37 GiB allocated (0.98 GiB already allocated")
    first, second = text.splitlines()[2:4]
    assert "300.0 MiB" in first and "/src/logits.py:7 logits" in first  # the caller, not torch's own frame
    assert "100.0 MiB" in second and "2 x" in second and "/src/attention.py:7" in second  # summed by line


def test_the_oom_line_names_the_snapshot(tmp_path: Path) -> None:
    import torch

    from shardtune.dist import DistContext
    from shardtune.train.loop import out_of_memory

    cfg = load_config(TINY, [])
    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    written = [tmp_path / "memory" / "rank0.pickle", tmp_path / "memory" / "rank0.txt"]
    line = str(out_of_memory(cfg, ctx, torch.OutOfMemoryError("CUDA out of memory."), "in step 3", written))
    assert line.startswith("out of GPU memory in step 3 on rank 0") and line.endswith(
        f"; allocations up to it: {written[-1]}")
    assert "allocations up to it" not in str(out_of_memory(cfg, ctx, RuntimeError("x"), "in step 3"))


class FakeHistory:
    """torch.cuda.memory's recorder as MemorySnapshot drives it (this CPU machine has no CUDA allocator): history
    on or off (`_record_memory_history`), allocation events kept only while on, `_snapshot()` in PyTorch's format."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[object] = []
        self.trace: list[dict] = []

    def record(self, enabled: object = "all", max_entries: int = 0, **_: object) -> None:
        self.calls.append(enabled)
        self.on = enabled is not None

    def alloc(self, addr: int, mib: int, where: str) -> None:
        if self.on:
            self.trace.append(_alloc(addr, mib, where))

    def snapshot(self) -> dict:
        return {"segments": [], "device_traces": [list(self.trace)]}


def _steps_until_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, oom_step: int) -> tuple[list[Path], str]:
    """Optimizer steps 1..5 with log.memory_snapshot [2, 4], as train/loop.py drives it (before each step, after it;
    each step run through the loop's own _no_oom guard, which on torch.OutOfMemoryError closes the snapshot with
    "out of memory" and raises the one-line error naming what it wrote); step `oom_step` runs out of memory.
    Returns the files close wrote and the error line."""
    from types import SimpleNamespace

    import torch

    from shardtune.dist import DistContext
    from shardtune.errors import ShardtuneError
    from shardtune.metrics.memory_snapshot import MemorySnapshot
    from shardtune.train.loop import _no_oom

    history = FakeHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", history.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", history.snapshot)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 512 * MIB)
    memory = MemorySnapshot(2, 4, tmp_path, rank=0, device=torch.device("cuda", 0))
    closed: list[list[Path]] = []
    close = memory.close
    monkeypatch.setattr(memory, "close", lambda reason="": closed.append(close(reason)) or closed[-1])
    run = SimpleNamespace(cfg=load_config(TINY, []), memory=memory,
                          ctx=DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu")))

    def step_fn(step: int) -> None:
        history.alloc(step, 10 * step, f"step{step}")
        if step == oom_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    for step in range(1, 6):
        memory.before(step)
        try:
            _no_oom(run, f"in step {step}", step_fn, step)
        except ShardtuneError as err:
            assert not history.on and closed  # recording stopped either way
            return closed[-1], str(err)
        memory.after(step)
    raise AssertionError("no out-of-memory error")


def test_an_oom_inside_the_steps_writes_the_snapshot_up_to_it(tmp_path: Path, monkeypatch) -> None:
    import pickle

    written, line = _steps_until_oom(tmp_path, monkeypatch, oom_step=3)
    assert written == [tmp_path / "memory" / "rank0.pickle", tmp_path / "memory" / "rank0.txt"]
    snapshot = pickle.loads(written[0].read_bytes())
    assert [e["addr"] for e in snapshot["device_traces"][0]] == [2, 3]  # steps 2 and 3 (the failed one)
    text = written[1].read_text()
    assert text.startswith("CUDA memory, steps 2-3 (out of memory): peak 0.55 GiB allocated (0.50 GiB already")
    assert "/src/step3.py:7 step3" in text.splitlines()[2]  # the failed step's allocation, the largest
    assert line.startswith("out of GPU memory in step 3 on rank 0") and line.endswith(str(written[1]))


def test_an_oom_outside_the_steps_records_nothing(tmp_path: Path, monkeypatch) -> None:
    """Before step A nothing is recording: no file. After step B the files of A..B were written when B ended; the
    error names none."""
    written, line = _steps_until_oom(tmp_path / "before", monkeypatch, oom_step=1)
    assert written == [] and not (tmp_path / "before" / "memory").exists() and "allocations up to it" not in line
    written, line = _steps_until_oom(tmp_path / "after", monkeypatch, oom_step=5)
    assert written == [] and "allocations up to it" not in line
    text = (tmp_path / "after" / "memory" / "rank0.txt").read_text()
    assert text.startswith("CUDA memory, steps 2-4: peak ")  # written at the end of step 4, no reason


def test_the_planner_does_not_pick_checkpointing_for_compiled_blocks_while_recording() -> None:
    """The same refusal inside the planner's search: with compiled blocks and a recording, `strategy: auto`
    prices no checkpointed candidate (validate would refuse it at launch), and without the recording it does."""
    from shardtune.models.build import load_hf_config
    from shardtune.plan import make_plan
    from shardtune.plan.hardware import GPUS

    def candidates(*overrides: str) -> set[str]:
        cfg = load_config(str(ROOT / "examples" / "llama-1b.yaml"), ["parallel.strategy=auto", "parallel.compile=true",
                                                                     *overrides])
        plan = make_plan(cfg, load_hf_config(cfg.model), GPUS["h200"], world=1, per_node=1)
        return {c.setting.activation_checkpointing for c in plan.result.candidates}

    assert candidates("log.memory_snapshot=[3,3]") == {"none"}
    assert candidates() == {"none", "selective", "full"}
