"""`shardtune calibrate`: the measurements that can run on a CPU, with tiny sizes, the record it writes and
reads back, and its refusal on a machine without a GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardtune.cli import main
from shardtune.plan.calibrate import (
    Sizes,
    bus_bandwidth,
    copy_bandwidth,
    format_table,
    host_adam_rate,
    host_copy_bandwidth,
    matmul_flops,
    measure,
    write_calibration,
)
from shardtune.plan.hardware import CALIBRATION_META, FIELDS, GPUS, Hardware, load_calibration

CPU = torch.device("cpu")
TINY = Sizes(matmul_n=64, matmul_iters=3, copy_bytes=2**20, copy_iters=3, host_copy_bytes=2**20,
             host_copy_iters=3, adam_params=50_000, adam_steps=2, warmup_s=0.0)


def _rate(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_bus_bandwidth_is_nccl_tests_busbw():
    # nccl-tests: busbw = algbw * (n-1)/n for all-gather and reduce-scatter.
    assert bus_bandwidth(8 * 10**9, 0.1, 8) == pytest.approx(80e9 * 7 / 8)
    assert bus_bandwidth(10**9, 0.01, 2) == pytest.approx(50e9)
    assert bus_bandwidth(10**9, 0.01, 1) == 0


def test_cpu_measurements_give_positive_rates():
    assert all(_rate(r) for r in matmul_flops(CPU, 64, 3, 0.0))
    assert _rate(copy_bandwidth(CPU, 2**20, 3, 0.0))
    h2d, d2h = host_copy_bandwidth(CPU, 2**20, 3, 0.0)
    assert _rate(h2d) and _rate(d2h)
    assert _rate(host_adam_rate(50_000, 2, "torch"))


def test_host_adam_rejects_an_unknown_implementation():
    with pytest.raises(ValueError, match="'torch' or 'deepspeed'"):
        host_adam_rate(1000, 1, "apex")


@pytest.fixture(scope="module")
def record():
    """One calibration record measured on the CPU with tiny sizes, laid over the H200's entry."""
    return measure(CPU, TINY, GPUS["h200"], gpus=1, adam_impl="torch")


def test_record_has_every_field_and_says_what_was_not_measured(record):
    assert set(record) == set(FIELDS) | set(CALIBRATION_META)
    assert record["name"] == "h200" and record["gpus"] == 1 and record["device_name"] == "cpu"
    assert set(record["not_measured"]) == {"intra_node_bus_bytes_per_s", "inter_node_bus_bytes_per_s"}
    h200 = GPUS["h200"]
    for key in record["not_measured"]:  # kept from the table
        assert record[key] == getattr(h200, key)
    for key in ("matmul_efficiency", "hbm_bytes_per_s", "h2d_bytes_per_s", "host_adam_params_per_s"):
        assert _rate(record[key]) and record[key] != getattr(h200, key)  # a CPU is no H200
        assert record["method"][key]
    assert "torch AdamW foreach" in record["method"]["host_adam_params_per_s"]


def test_record_round_trips_through_load_calibration(record, tmp_path):
    path = tmp_path / "sub" / "calibration.json"
    path.parent.mkdir()
    write_calibration(record, path)
    assert load_calibration(path) == Hardware(**{key: record[key] for key in FIELDS})
    assert not list(path.parent.glob("*.tmp"))


def test_table_shows_measured_beside_the_table(record):
    text = format_table(record, GPUS["h200"], Path("c.json"))
    intra = next(line for line in text.splitlines() if line.startswith("intra-node bus"))
    assert "not measured" in intra and "360.0 GB/s" in intra
    assert "139.8 GiB" in text


def test_a_failing_measurement_is_recorded_and_the_rest_go_on():
    sizes = Sizes(**{**TINY.__dict__, "matmul_n": -1})  # torch refuses a negative size
    rec = measure(CPU, sizes, GPUS["l4"], gpus=1, adam_impl="torch")
    assert "bf16 matmul failed: RuntimeError" in rec["not_measured"]["matmul_efficiency"]
    assert rec["matmul_efficiency"] == GPUS["l4"].matmul_efficiency
    assert "matmul_efficiency" not in rec["method"]
    assert rec["hbm_bytes_per_s"] != GPUS["l4"].hbm_bytes_per_s


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine")
def test_cli_refuses_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--out", str(out), "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: calibrate needs a CUDA GPU") and "--gpu" in err[0]
    assert not out.exists()
