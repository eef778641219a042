"""One metrics logger with a console (rich progress bar) and a JSONL file behind it; rank 0 only."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, soft_wrap=True)  # log lines stay whole in files and pipes


def log_rank0(rank: int, message: str) -> None:
    if rank == 0:
        console.print(message, highlight=False)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    """`log(record)` appends a JSON line and updates the progress bar. No-ops on ranks other than 0."""

    def __init__(self, rank: int, output_dir: Path, total_steps: int, *, progress: bool, jsonl: bool,
                 resume_step: int = 0, trackers: Callable[[], list[Any]] | None = None) -> None:
        self.active = rank == 0
        self.explained = False  # eval_line has said what exact match means
        self.file = None
        # log.tensorboard / wandb / mlflow (metrics/trackers.py): made here, on rank 0 only.
        self.trackers: list[Any] = trackers() if trackers is not None and self.active else []
        self.progress: Progress | None = None
        if not self.active:
            return
        if jsonl:
            output_dir.mkdir(parents=True, exist_ok=True)
            path = output_dir / "metrics.jsonl"
            # A resumed run keeps the records up to its checkpoint and drops any logged after it
            # (those steps run again).
            kept = _records_up_to(path, resume_step) if resume_step else []
            self.file = path.open("w")
            self.file.writelines(kept)
        if progress:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task("train", total=total_steps, completed=resume_step, info="")
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if self.file is not None:
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()
        if self.trackers and "step" in record:
            from shardtune.metrics.trackers import scalars

            numbers = scalars(record)
            for tracker in self.trackers:
                tracker.log(numbers, int(record["step"]))
        if self.progress is not None and "loss" in record:
            info = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_sec']:,.0f} tok/s"
            self.progress.update(self.task, completed=record["step"], info=info)

    def print(self, message: str) -> None:
        if self.active:
            (self.progress.console if self.progress else console).print(message, highlight=False)

    def eval_line(self, step: int, metrics: dict[str, Any]) -> None:
        """`step N: eval loss L, exact match A%`; the first one also says what exact match means (a small model
        can lower the loss long before it gets a whole answer right)."""
        text = f"step {step}: eval loss {_fmt(metrics.get('eval_loss'))}"
        if metrics.get("eval_accuracy") is not None:
            text += f", exact match {metrics['eval_accuracy']:.1%}"
            if not self.explained:
                text += " (held-out answers whose every token is the model's greedy choice)"
                self.explained = True
        self.print(text)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()


def _records_up_to(path: Path, step: int) -> list[str]:
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue  # a line cut short by a crash
    return kept
