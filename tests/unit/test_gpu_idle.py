"""metrics/gpu_idle.py: the GPU's idle gaps in a profiler trace, each put down to what ended it. The trace below
is torch.profiler's Chrome format (the fields export_chrome_trace writes) for one step; on the GPU machine the
same report ends every log.profile table."""

from __future__ import annotations

import json

import torch

from shardtune.metrics.gpu_idle import idle_report


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat == "kernel" else 7, "tid": tid, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace() -> dict:
    return {"traceEvents": [
        _x("user_annotation", "ProfilerStep#5", 0, 1000),
        _x("cpu_op", "aten::mm", 5, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 2, corr=1),
        _x("kernel", "gemm", 20, 80, corr=1),                      # idle 0-20: the host launched it late
        _x("cpu_op", "Optimizer.step", 100, 150),
        _x("cpu_op", "aten::_fused_adamw_", 150, 50),
        _x("cuda_driver", "cuLaunchKernelEx", 160, 2, corr=2),
        _x("kernel", "adamw", 170, 130, corr=2),                   # idle 100-170: the optimizer launched late
        _x("cuda_runtime", "cudaLaunchKernel", 200, 2, corr=3),
        _x("kernel", "copy", 350, 50, corr=3),                     # idle 300-350: queued before the GPU idled
        _x("cpu_op", "aten::item", 395, 110),
        _x("cpu_op", "aten::_local_scalar_dense", 398, 104),
        _x("cuda_runtime", "cudaStreamSynchronize", 400, 100),
        _x("cpu_op", "aten::add", 515, 20, tid=2),                 # another thread's operator is not the launcher
        _x("cuda_runtime", "cudaLaunchKernel", 520, 2, corr=4),
        _x("kernel", "next", 530, 470, corr=4),                    # idle 400-530: after the sync
    ]}


def test_gaps_are_summed_and_labelled_by_what_ended_them() -> None:
    r = idle_report(_trace())
    assert (r.window_us, r.busy_us, r.idle_us, r.steps) == (1000, 730, 270, 1)
    got = {label: (int(v[0]), v[1]) for label, v in r.by_label.items()}
    assert got == {"aten::mm": (1, 20.0), "Optimizer.step > aten::_fused_adamw_": (1, 70.0),
                   "queued (waited on another stream or event)": (1, 50.0),
                   "after cudaStreamSynchronize in aten::item > aten::_local_scalar_dense": (1, 130.0)}
    text = r.text()
    assert text.startswith("GPU idle: 0.27 ms a step of 1.00 (27.0%) over 1 step(s)")
    assert text.index("after cudaStreamSynchronize") < text.index("Optimizer.step") < text.index("aten::mm")


def test_overlapping_kernels_count_once_and_short_gaps_are_launch_latency() -> None:
    events = [_x("user_annotation", "ProfilerStep#1", 0, 100),
              _x("cuda_runtime", "cudaLaunchKernel", 0, 1, corr=1), _x("kernel", "a", 0, 60, corr=1),
              _x("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=2), _x("kernel", "b", 30, 40, tid=2, corr=2),
              _x("cuda_runtime", "cudaLaunchKernel", 2, 1, corr=3), _x("kernel", "c", 73, 27, corr=3)]
    r = idle_report({"traceEvents": events})
    assert (r.busy_us, r.idle_us, r.by_label) == (97, 3, {})  # 70-73 is under MIN_GAP_US


def test_a_cpu_trace_has_no_gpu_report(tmp_path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert idle_report(json.loads((tmp_path / "t.json").read_text())).text() == \
        "GPU idle: no GPU kernels in the trace\n"
