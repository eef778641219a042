"""metrics/comm_kernels.py: achieved bus bandwidth = the comm counter's bus bytes over the profiled steps / the
NCCL kernels' time in the same steps. The trace is torch.profiler's Chrome format with NCCL 2.2x kernel names;
on two GPUs tests/gpu runs the same through a real profiled run."""

from __future__ import annotations

import pytest

from shardtune.metrics.comm_kernels import bandwidth, nccl_kind, text


def _k(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_Reduce_Sum_bf16_RING_LL", "reduce"),
    ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_all"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_32x6_tn", None),
    ("void at::native::reduce_kernel<512, 1>(...)", None),
])
def test_nccl_kernels_are_named_by_their_collective(name: str, kind: str | None) -> None:
    assert nccl_kind(name) == kind


def test_bandwidth_is_bus_bytes_over_kernel_time_per_collective() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 1000, "dur": 1000},
        _k("ncclDevKernel_AllGather_RING_LL(x)", 10, 100),
        _k("ncclDevKernel_AllGather_RING_LL(x)", 1010, 300),
        _k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 1500, 200),
        _k("gemm", 200, 500),
        _k("ncclDevKernel_AllGather_RING_LL(x)", 2500, 999),  # after the profiled steps: not counted
    ]}
    totals = {"all_gather": {"calls": 2, "bytes": 8e6, "bus_bytes": 4e6},
              "reduce_scatter": {"calls": 1, "bytes": 4e6, "bus_bytes": 2e6},
              "all_reduce": {"calls": 2, "bytes": 8.0, "bus_bytes": 8.0}}  # gloo-side or no kernel: no rate
    rows = bandwidth(trace, totals)
    assert rows["all_gather"] == pytest.approx({"bus_bytes_per_step": 2e6, "kernel_ms_per_step": 0.2,
                                                "kernels_per_step": 1.0, "bus_bytes_per_s": 4e6 / 400e-6})
    assert rows["reduce_scatter"]["bus_bytes_per_s"] == pytest.approx(2e6 / 200e-6)
    assert "bus_bytes_per_s" not in rows["all_reduce"] and rows["all_reduce"]["kernel_ms_per_step"] == 0
    table = text(rows)
    assert "all_gather" in table and f"{4e6 / 400e-6 / 1e9:10.1f}" in table


def test_a_trace_without_gpu_kernels_gives_bytes_and_no_rate() -> None:
    rows = bandwidth({"traceEvents": []}, {"all_gather": {"calls": 1, "bytes": 2.0, "bus_bytes": 1.0}})
    assert rows == {"all_gather": {"bus_bytes_per_step": 1.0, "kernel_ms_per_step": 0.0, "kernels_per_step": 0.0}}


def test_the_report_names_each_runs_bandwidth_under_its_collective() -> None:
    from shardtune.report import _comm_tick

    rows = [(None, {"profiled": {"all_gather": {"bus_bytes_per_s": 123.4e9}}}), (None, {"profiled": None}),
            (None, {"profiled": {"all_gather": {"bus_bytes_per_s": 80e9}, "all_reduce": {"kernels_per_step": 0}}})]
    assert _comm_tick("all_gather", rows) == "all-gather\n123 GB/s, 80 GB/s"
    assert _comm_tick("all_reduce", rows) == "all-reduce"
