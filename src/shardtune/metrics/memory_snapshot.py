"""`log.memory_snapshot: [A, B]`: PyTorch's CUDA allocator history of optimizer steps A..B (1-based, as
metrics.jsonl counts them), per rank: OUTPUT_DIR/memory/rank{R}.pickle, which PyTorch's memory viewer opens
(https://pytorch.org/memory_viz, drag the file in), and rank{R}.txt, a short summary: the peak allocated during
those steps and the allocations alive at that moment summed by the line of code (outside torch) that made them.
An out-of-memory error in a training step (or an evaluation) inside A..B writes both too, up to the failed
allocation, the summary naming the steps recorded (`steps A-S (out of memory)`, S the failed step) and the one-line
OOM error naming the files. Outside A..B an out-of-memory error records nothing: before step A (or while the model
is built) nothing is recording yet, and after step B the files of A..B are already written (that error names none).
CUDA only (`torch.cuda.memory._record_memory_history`); validate refuses it on other devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Allocation events kept (a ring buffer in PyTorch): a step of a large model makes tens of thousands.
MAX_ENTRIES = 200_000
TOP = 15  # allocations listed in the text summary


class MemorySnapshot:
    def __init__(self, first: int, last: int, out: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = first, last
        self.dir = out / "memory"
        self.rank = rank
        self.device = device
        self.recording = False
        self.baseline = 0  # bytes allocated when recording started (no frames for those)
        self.step = 0  # the last step begun while recording: where a run that stops inside A..B got to
        self.written: list[Path] = []

    def before(self, step: int) -> None:
        """Call before optimizer step `step` (1-based) starts."""
        if step == self.first and not self.recording and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True
        if self.recording:
            self.step = step

    def after(self, step: int) -> None:
        """Call when optimizer step `step` has ended: the snapshot is written after step B."""
        if self.recording and step >= self.last:
            self.close()

    def close(self, reason: str = "") -> list[Path]:
        """Write the snapshot and its summary (also when the run ends or fails inside A..B, `reason` saying why);
        returns the files, none when nothing is recording (before A, or after B: written already)."""
        if not self.recording:
            return []
        self.recording = False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.dir.mkdir(parents=True, exist_ok=True)
        pickle_path = self.dir / f"rank{self.rank}.pickle"
        import pickle

        with pickle_path.open("wb") as f:
            pickle.dump(snapshot, f)
        text_path = self.dir / f"rank{self.rank}.txt"
        steps = f"steps {self.first}-{min(self.step, self.last)}" + (f" ({reason})" if reason else "")
        text_path.write_text(summary_text(snapshot, self.baseline, steps))
        self.written = [pickle_path, text_path]
        return self.written


def peak_allocations(snapshot: dict[str, Any], baseline: int = 0) -> tuple[int, list[dict[str, Any]]]:
    """Replay the recorded allocator events of the device: (peak bytes allocated, the traced allocations alive at
    that peak, largest first). `baseline`: bytes allocated before recording started (alive throughout, no
    frames). Events: 'alloc' makes a block, 'free_requested' ends it (PyTorch's viewer counts it freed there)."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            action, addr = event.get("action"), event.get("addr")
            if action == "alloc":
                live[addr] = event
                total += int(event.get("size", 0))
                if total > peak:
                    peak, at_peak = total, list(live.values())
            elif action == "free_requested" and addr in live:
                total -= int(live.pop(addr).get("size", 0))
    return baseline + peak, sorted(at_peak, key=lambda e: -int(e.get("size", 0)))


def _where(event: dict[str, Any]) -> str:
    """The first Python frame outside torch's own files (the model, PEFT or shardtune line that asked), else the
    first Python frame, else the first frame. CUDA snapshots start with C++ frames (the allocator's own, e.g.
    memory_snapshot.cpp's gather_with_cpp), which name no caller."""
    frames = event.get("frames") or []
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for frame in python:
        if "/torch/" not in str(frame.get("filename", "")):
            return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"
    for frame in python or frames:
        return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"
    return "?"


def summary_text(snapshot: dict[str, Any], baseline: int, steps: str) -> str:
    """The text beside the pickle: the peak and the allocations alive at it, summed by the line that made them,
    largest first (a model's blocks make the same allocation once each: one line with its count)."""
    peak, live = peak_allocations(snapshot, baseline)
    gib, mib = 2**30, 2**20
    by_where: dict[str, list[int]] = {}
    for event in live:
        total_count = by_where.setdefault(_where(event), [0, 0])
        total_count[0] += int(event.get("size", 0))
        total_count[1] += 1
    traced = sum(int(e.get("size", 0)) for e in live)
    lines = [f"CUDA memory, {steps}: peak {peak / gib:.2f} GiB allocated ({baseline / gib:.2f} GiB already "
             f"allocated when recording started, {len(live)} traced allocations alive at the peak)",
             f"alive at the peak by the line that allocated them (of {traced / gib:.2f} GiB traced):"]
    for where, (size, count) in sorted(by_where.items(), key=lambda kv: -kv[1][0])[:TOP]:
        lines.append(f"  {size / mib:10.1f} MiB  {count:4d} x  {where}")
    lines.append("open the .pickle in https://pytorch.org/memory_viz for the timeline")
    return "\n".join(lines) + "\n"
