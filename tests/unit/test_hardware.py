"""The per-GPU-type hardware table: names and aliases, memory sizes, detection, calibration files."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from shardtune.errors import ShardtuneError
from shardtune.metrics.flops import peak_flops
from shardtune.plan.hardware import (
    FIELDS,
    GPUS,
    calibration_path,
    detect,
    load_calibration,
    lookup,
    parse_memory,
)

# The name torch.cuda.get_device_name() gives for each table entry.
DEVICE_NAMES = {
    "h200": "NVIDIA H200",
    "h100": "NVIDIA H100 80GB HBM3",
    "h100-pcie": "NVIDIA H100 PCIe",
    "a100-80gb": "NVIDIA A100-SXM4-80GB",
    "a100-40gb": "NVIDIA A100-SXM4-40GB",
    "l40s": "NVIDIA L40S",
    "rtx4090": "NVIDIA GeForce RTX 4090",
    "a10g": "NVIDIA A10G",
    "l4": "NVIDIA L4",
    "b200": "NVIDIA B200",
}


def test_device_names_cover_the_table():
    assert set(DEVICE_NAMES) == set(GPUS)


@pytest.mark.parametrize("key", sorted(DEVICE_NAMES))
def test_device_name_maps_to_its_entry(key):
    assert lookup(DEVICE_NAMES[key]).name == key
    assert lookup(key.upper()).name == key


@pytest.mark.parametrize("key", sorted(DEVICE_NAMES))
def test_one_peak_table_for_mfu_and_the_planner(key):
    # MFU in the training loop and the planner's prices read the same peak for the same device.
    assert GPUS[key].bf16_flops == peak_flops(DEVICE_NAMES[key])


@pytest.mark.parametrize("name, key", [
    ("H200", "h200"),
    ("nvidia h200", "h200"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("A100_80GB", "a100-80gb"),
    ("h100-sxm", "h100"),
    ("H100 SXM5 80GB", "h100"),
    ("RTX 4090", "rtx4090"),
    ("Tesla L4", "l4"),
])
def test_aliases(name, key):
    assert lookup(name).name == key


@pytest.mark.parametrize("name", ["L40", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "v100", "", "4090"])
def test_unknown_gpu_lists_the_known_ones(name):
    # The H100 NVL (94 GB, 400 W) and the L40 are other cards: no silent mapping to a neighbour.
    with pytest.raises(ShardtuneError) as err:
        lookup(name)
    message = str(err.value)
    assert repr(name) in message and "\n" not in message
    assert all(key in message for key in GPUS)


def test_a100_without_size_is_ambiguous_unless_memory_says():
    with pytest.raises(ShardtuneError, match="a100-80gb or a100-40gb"):
        lookup("NVIDIA A100")
    assert lookup("NVIDIA A100", memory_bytes=40536 * 2**20).name == "a100-40gb"
    assert lookup("NVIDIA A100", memory_bytes=81920 * 2**20).name == "a100-80gb"


@pytest.mark.parametrize("key", sorted(GPUS))
def test_table_entries_are_sane(key):
    hw = GPUS[key]
    assert 0 < hw.matmul_efficiency <= 1
    assert 10 * 2**30 < hw.memory_bytes < 200e9
    # Links are slower than device memory; across nodes no faster than within one.
    assert hw.inter_node_bus_bytes_per_s <= hw.intra_node_bus_bytes_per_s < hw.hbm_bytes_per_s
    assert all(math.isfinite(v) and v > 0 for k, v in asdict(hw).items() if k in FIELDS[1:])
    assert hw.host_memory_bytes is None  # a table entry's host is unknown: plan checks it only where it is known


def test_h200_memory_is_what_torch_reports():
    # torch reported 150,109,880,320 bytes (139.8 GiB) on the H200 here, below the datasheet's 141 GB.
    assert GPUS["h200"].memory_bytes / 2**30 == pytest.approx(139.8, abs=0.05)


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30),
    ("80GB", 80 * 10**9),
    ("141 GB", 141 * 10**9),
    ("139.8GiB", int(139.8 * 2**30)),
    ("24gib", 24 * 2**30),
    ("512MiB", 512 * 2**20),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("80", "give a unit"),
    ("eighty GiB", "not a size"),
    ("80 GiBs", "not a size"),
    ("-5GB", "not a size"),
    ("0GiB", "more than 0"),
])
def test_parse_memory_errors(text, fragment):
    with pytest.raises(ShardtuneError, match=fragment):
        parse_memory(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine")
def test_detect_is_none_without_a_gpu():
    assert detect() is None


def test_calibration_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDTUNE_CALIBRATION", str(tmp_path / "c.json"))
    assert calibration_path() == tmp_path / "c.json"
    monkeypatch.delenv("SHARDTUNE_CALIBRATION")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration_path() == tmp_path / ".cache" / "shardtune" / "calibration.json"


def test_calibration_overrides_only_what_it_holds(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"name": "h200", "hbm_bytes_per_s": 4.1e12, "memory_bytes": 150_000_000_000,
                                "not_measured": {"intra_node_bus_bytes_per_s": "1 GPU visible"}}))
    hw = load_calibration(path)
    assert hw.hbm_bytes_per_s == 4.1e12 and hw.memory_bytes == 150_000_000_000
    assert isinstance(hw.memory_bytes, int)
    for key in set(FIELDS) - {"hbm_bytes_per_s", "memory_bytes"}:
        assert getattr(hw, key) == getattr(GPUS["h200"], key)


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "no GPU type"),
    ('{"hbm_bytes_per_s": 1e12}', "no GPU type"),
    ('{"name": "v100"}', "unknown GPU type 'v100'"),
    ('{"name": "h200", "hbm_bandwidth": 1e12}', "unknown key(s) hbm_bandwidth"),
    ('{"name": "h200", "hbm_bytes_per_s": 0}', "hbm_bytes_per_s = 0 is not a positive number"),
    ('{"name": "h200", "hbm_bytes_per_s": "fast"}', "is not a positive number"),
    ('{"name": "h200", "matmul_efficiency": true}', "is not a positive number"),
    ('{"name": "h200", "matmul_efficiency": NaN}', "is not a positive number"),
])
def test_bad_calibration_files(tmp_path, content, fragment):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ShardtuneError) as err:
        load_calibration(path)
    assert fragment in str(err.value) and str(path) in str(err.value)


SMI = """0, GPU-aaaa1111, NVIDIA H200, 143771, 616, Disabled
1, GPU-bbbb2222, NVIDIA H200, 143771, 616, Disabled
2, GPU-cccc3333, NVIDIA H200, 143771, 616, Disabled
"""


@pytest.mark.parametrize("visible, expected", [
    (None, 3),
    ("", 0),
    ("2,0", 2),
    ("GPU-bbbb", 1),  # a UUID prefix, as CUDA takes it
    ("1,7,2", 1),  # CUDA stops at the first device it cannot match
    ("1,1", 1),
])
def test_nvidia_smi_rows_as_cuda_shows_them(visible, expected):
    """`plan` on a GPU node asks nvidia-smi (no torch import): the GPUs CUDA_VISIBLE_DEVICES leaves visible."""
    from shardtune.launch import visible_from_smi

    gpus = visible_from_smi(SMI, visible, None)
    assert len(gpus) == expected
    assert all(g.name == "NVIDIA H200" and g.memory_bytes == (143771 - 616) * 2**20 for g in gpus)


def test_what_only_cuda_can_say_is_left_to_torch():
    from shardtune.launch import visible_from_smi

    mig = SMI.replace("bbbb2222, NVIDIA H200, 143771, 616, Disabled", "bbbb2222, NVIDIA H200, 143771, 616, Enabled")
    assert visible_from_smi(mig, None, None) is None  # nvidia-smi gives the whole GPU's memory, not the slice's
    mixed = SMI.replace("2, GPU-cccc3333, NVIDIA H200, 143771", "2, GPU-cccc3333, NVIDIA A100-SXM4-80GB, 81920")
    assert visible_from_smi(mixed, "2", None) is None  # CUDA's fastest-first order need not be nvidia-smi's
    assert visible_from_smi(mixed, "2", "PCI_BUS_ID")[0].name == "NVIDIA A100-SXM4-80GB"
    assert visible_from_smi("No devices were found\n", None, None) is None
    assert visible_from_smi(SMI, "MIG-1234abcd", None) is None  # a MIG slice named in CUDA_VISIBLE_DEVICES
    assert visible_from_smi(SMI.replace(", 616,", ", [N/A],"), None, None) is None  # a driver without the field


def test_no_driver_means_no_gpu_without_asking_torch(monkeypatch):
    import shardtune.launch as launch

    monkeypatch.setattr(launch, "_GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    assert launch.local_gpus() == [] and launch.local_gpu_count() == 0 and detect() is None


def test_a_gpu_node_is_detected_through_nvidia_smi_without_torch(tmp_path):
    """The wiring (device file, nvidia-smi on PATH, its CSV) in a fresh interpreter; there is no NVIDIA driver on
    the CPU machines, so nvidia-smi is a script printing a real H200's answer (the GPU machine runs the real one,
    bench/RESULTS.md 2026-12-04)."""
    import os
    import subprocess
    import sys

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, GPU-aaaa1111, NVIDIA H200, 143771, 616, Disabled\\n'\n")
    smi.chmod(0o755)
    ctl = tmp_path / "nvidiactl"
    ctl.touch()
    code = (f"import sys, shardtune.launch as launch\nlaunch._GPU_DEVICE_FILES = ({str(ctl)!r},)\n"
            "from shardtune.plan.hardware import detect\nhw = detect()\n"
            "print(hw.name, launch.local_gpu_count(), round(hw.memory_bytes / 2**20), 'torch' in sys.modules)")
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["h200", "1", "143155", "False"]
