"""Profile a few optimizer steps of `shardtune train` in one process (torch.profiler).

    python bench/profile_run.py CONFIG [OVERRIDE ...] [--steps 3:5] [--out DIR]

Steps first..last (1-based, after warm-up) are profiled; prints the top CUDA kernels and the top
CPU-side ops, and writes a Chrome trace (trace.json) under --out. For finding where a step's time
goes, not for throughput numbers (the profiler slows the CPU side).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from shardtune.config import load_config
from shardtune.parallel.deepspeed_engine import DeepSpeedBackend
from shardtune.parallel.fsdp2_engine import FSDP2Backend
from shardtune.train.loop import run_training


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", default="3:5", help="first:last optimizer step to profile")
    ap.add_argument("--out", default="/tmp/shardtune_profile")
    a = ap.parse_args()
    first, last = (int(x) for x in a.steps.split(":"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=first - 1, warmup=0, active=last - first + 1,
                                                            repeat=1))
    for cls in (FSDP2Backend, DeepSpeedBackend):  # advance the profiler after every optimizer step
        original = cls.step

        def step(self, _original=original):
            norm = _original(self)
            prof.step()
            return norm
        cls.step = step
    cfg = load_config(a.config, a.overrides)
    with prof:
        run_training(cfg)
    averages = prof.key_averages()
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    prof.export_chrome_trace(str(out / "trace.json"))


if __name__ == "__main__":
    main()
