"""`log.profile: {start: S, steps: K}`: optimizer steps S..S+K-1 (1-based, as metrics.jsonl counts them) run
under torch.profiler, and each rank writes a Chrome / Perfetto trace, OUTPUT_DIR/profile/rank{R}.json (open it
in chrome://tracing or ui.perfetto.dev), and rank{R}.txt, the operators and kernels that took the most time
(torch.profiler's own table: by CUDA time on GPUs, by CPU time elsewhere; on GPUs followed by the GPU's idle
time and what ended its gaps: metrics/gpu_idle.py, and the collectives' achieved bus bandwidth:
metrics/comm_kernels.py). CPU activity everywhere, CUDA kernels on GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardtune.metrics import comm, comm_kernels
from shardtune.metrics.gpu_idle import idle_report

TOP = 30  # rows of the text table


class StepProfiler:
    def __init__(self, start: int, steps: int, out: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = start, start + steps - 1
        self.path = out / "profile" / f"rank{rank}.json"
        self.table_path = self.path.with_suffix(".txt")
        self.device = device
        self.prof: Any = None
        self.span: Any = None  # the current step's record_function
        self.comm: dict[str, dict[str, float]] = {}  # the comm counter's totals over the profiled steps
        self.collectives: dict[str, dict[str, float]] | None = None  # comm_kernels.bandwidth, once written
        self._fields_taken = False

    def add_comm(self, step: int, totals: dict[str, dict[str, float]]) -> None:
        """The collectives optimizer step `step` issued (counted by metrics/comm.py)."""
        if self.first <= step <= self.last:
            comm.merge(self.comm, totals)

    def take_fields(self) -> dict[str, float]:
        """metrics.jsonl's comm_<kind>_bus_gbps of the profiled steps, once, after the trace is written."""
        if self.collectives is None or self._fields_taken:
            return {}
        self._fields_taken = True
        return {f"comm_{kind}_bus_gbps": r["bus_bytes_per_s"] / 1e9 for kind, r in self.collectives.items()
                if "bus_bytes_per_s" in r}

    def before(self, step: int) -> None:
        """Call before optimizer step `step` (1-based) starts."""
        if not self.first <= step <= self.last:
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        # One span per optimizer step, named as the trace viewers' own step markers are, with metrics.jsonl's step.
        self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.span.__enter__()

    def after(self, step: int) -> None:
        """Call when optimizer step `step` has ended; the trace is written after the last profiled step."""
        if self.prof is None:
            return
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if step >= self.last:
            self.close()

    def close(self) -> Path | None:
        """Stop and write the trace (also when the run ends before the last profiled step); None if nothing to
        write."""
        if self.prof is None:
            return None
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        prof, self.prof = self.prof, None
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        steps = f"steps {self.first}-{self.last}"
        extra = ""
        if self.device.type == "cuda":
            trace = json.loads(self.path.read_text())
            self.collectives = comm_kernels.bandwidth(trace, self.comm)
            extra = idle_report(trace).text() + "\n" + comm_kernels.text(self.collectives)
        self.table_path.write_text(f"{steps}, by {sort_by}\n" +
                                   prof.key_averages().table(sort_by=sort_by, row_limit=TOP) + "\n" + extra)
        return self.path
