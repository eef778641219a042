"""The ceilings the planner prices a training step with, per GPU type.

Each entry holds datasheet peaks and typical achieved rates, with the source beside each
number. `shardtune calibrate` measures a machine's own rates and writes them to a JSON file;
`load_calibration` lays that file over the table entry of its GPU type.

Conventions: bytes and seconds; bandwidths are what a program achieves (NCCL's bus bandwidth
as nccl-tests reports it, a pinned copy's rate, a device copy counting bytes read + written),
not the line rate on a datasheet; only `bf16_flops` is a datasheet peak, and
`matmul_efficiency` says how much of it large GEMMs reach.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from shardtune.config import parse_size
from shardtune.errors import ShardtuneError
from shardtune.metrics.flops import PEAK_FLOPS


@dataclass(frozen=True)
class Hardware:
    name: str  # the table's key, e.g. "h200"
    memory_bytes: int  # usable device memory per GPU: torch's total_memory, bytes
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s (datasheet)
    matmul_efficiency: float  # achieved / peak for large bf16 GEMMs
    intra_node_bus_bytes_per_s: float  # NCCL bus bandwidth within a node (all-gather / reduce-scatter)
    inter_node_bus_bytes_per_s: float  # per GPU across nodes
    h2d_bytes_per_s: float  # pinned host<->device copy, the slower direction
    host_adam_params_per_s: float  # CPU AdamW rate of one node (DeepSpeed CPU Adam), parameters/s
    hbm_bytes_per_s: float  # device memory bandwidth (a large copy, bytes read + written)
    # Host memory of one node, bytes: known for the local machine (detect) or when the user names it
    # (--host-memory); None for a GPU type named from the table, whose host the planner cannot know.
    host_memory_bytes: int | None = None


# The fields a calibration file may set (the host's memory is not a GPU ceiling).
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Hardware) if f.name != "host_memory_bytes")
MIB = 2**20

# Links. NCCL bus bandwidth ("busbw" in nccl-tests) is what all-gather and reduce-scatter reach at
# large messages; it is well below the NVLink line rate.
NVLINK4_BUS = 360e9  # NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU; 8 GPUs reach ~360-400 GB/s busbw
NVLINK3_BUS = 230e9  # NVLink 3 (A100 SXM): 600 GB/s bidirectional; 8 GPUs reach ~230 GB/s busbw
NVLINK5_BUS = 720e9  # NVLink 5 (B200): 1.8 TB/s bidirectional, twice NVLink 4; NVLink 4's busbw scaled (estimate)
PCIE5 = 50e9  # PCIe Gen5 x16: 64 GB/s per direction on paper, ~50 GB/s for pinned copies
PCIE4 = 25e9  # PCIe Gen4 x16: 32 GB/s per direction on paper, ~25 GB/s for pinned copies
PCIE5_BUS = 40e9  # NCCL rings over PCIe Gen5 through the host bridge, no NVLink (estimate)
PCIE4_BUS = 20e9  # the same over PCIe Gen4 (estimate)
NO_P2P_BUS = 12e9  # GeForce cards have peer-to-peer disabled: NCCL stages through host memory (estimate)
IB_400G = 50e9  # one 400 Gb/s NDR InfiniBand / RoCE NIC per GPU (DGX H100, H200, B200)
IB_200G = 25e9  # one 200 Gb/s HDR NIC per GPU (DGX A100)
ETH_100G_PER_8 = 100e9 / 8 / 8  # AWS g5/g6.48xlarge: 100 Gb/s for the node's 8 GPUs
ETH_10G = 10e9 / 8  # a workstation's 10 GbE

# Host AdamW, parameters/s per node. DeepSpeed's CPU Adam is memory-bound: ~28 bytes read + written per
# parameter (fp32 param, grad, two moments); a two-socket server moves ~100+ GB/s through it, a desktop
# with two DDR5 channels ~20. Rough: `shardtune calibrate` measures the real rate.
SERVER_ADAM = 2e9
# The one-GPU H200 machine's 16 host cores: 1.46e9 parameters/s, from a DeepSpeed ZeRO-3 + CPU-offload run
# of the 1B shape (step time less the planner's GPU and PCIe terms; bench/RESULTS.md, planner accuracy).
H200_HOST_ADAM = 1.46e9
DESKTOP_ADAM = 0.5e9

# Device memory: achieved copy rates are ~90% of the datasheet's (the H200 here: 4.3 of 4.8 TB/s).
HBM_ACHIEVED = 0.9

# memory_bytes: torch.cuda.get_device_properties().total_memory, which is a few hundred MiB below
# nvidia-smi's total (the driver's reserve). Values from public logs of `_CudaDeviceProperties(...)`.
GPUS: dict[str, Hardware] = {
    h.name: h
    for h in [
        # H200 SXM: 141 GB HBM3e at 4.8 TB/s (datasheet). torch reports 150,109,880,320 bytes (139.8 GiB;
        # nvidia-smi 143,771 MiB). Measured on the H200 lent here (`shardtune calibrate`, 2026-12-01): 8192^3
        # bf16 GEMMs ~790 TFLOP/s in a burst (0.80 of 989: the efficiency kept here, which plan/speed.py's
        # constants were fitted against), 660-690 sustained after ~0.5 s at the 700 W power limit; device
        # copy 4.3 TB/s; pinned copies 55 GB/s each way.
        Hardware("h200", 150_109_880_320, PEAK_FLOPS["H200"], 0.80, NVLINK4_BUS, IB_400G, 55e9, H200_HOST_ADAM, 4.3e12),
        # H100 SXM5 80 GB: HBM3 3.35 TB/s; the H200's chip and power limit. Its GEMM efficiency fitted to the
        # 114 steady rows measured on the H100 lent here (calls 74-141): at the H200's 0.80 every group ran faster
        # than priced (1B full fine-tuning 2.4%, 8B LoRA 2.9%, 8B QLoRA 4.9% on average); at 0.82 the 1B rows,
        # where compute is all, average 0.0% (bench/RESULTS.md, forty-sixth session). torch: 81,090 MiB.
        Hardware("h100", 81090 * MIB, PEAK_FLOPS["H100"], 0.82, NVLINK4_BUS, IB_400G, PCIE5, SERVER_ADAM,
                 3.35e12 * HBM_ACHIEVED),
        # H100 PCIe 80 GB: 756 TFLOP/s bf16 dense at 350 W, HBM2e 2.0 TB/s, no NVLink unless bridged in
        # pairs. torch: 81,008 MiB. Efficiency an estimate (power-capped).
        Hardware("h100-pcie", 81008 * MIB, PEAK_FLOPS["H100 PCIE"], 0.75, PCIE5_BUS, IB_200G, PCIE5, SERVER_ADAM,
                 2.0e12 * HBM_ACHIEVED),
        # A100 SXM4 80 GB: 312 TFLOP/s bf16, HBM2e 2.039 TB/s, NVLink 3; DGX A100 has one 200 Gb/s HDR NIC
        # per GPU. torch: 81,920 MiB in the one public log found (other drivers may report a little less).
        Hardware("a100-80gb", 81920 * MIB, PEAK_FLOPS["A100"], 0.80, NVLINK3_BUS, IB_200G, PCIE4, SERVER_ADAM,
                 2.039e12 * HBM_ACHIEVED),
        # A100 SXM4 40 GB: HBM2 1.555 TB/s. torch: 40,536 MiB.
        Hardware("a100-40gb", 40536 * MIB, PEAK_FLOPS["A100"], 0.80, NVLINK3_BUS, IB_200G, PCIE4, SERVER_ADAM,
                 1.555e12 * HBM_ACHIEVED),
        # L40S: 362 TFLOP/s bf16 dense, 48 GB GDDR6 at 864 GB/s, PCIe Gen4, no NVLink. torch: 45,589 MiB.
        # Efficiency an estimate (clocks drop under sustained GEMMs at 350 W).
        Hardware("l40s", 45589 * MIB, PEAK_FLOPS["L40S"], 0.70, PCIE4_BUS, 100e9 / 8, PCIE4, SERVER_ADAM,
                 864e9 * HBM_ACHIEVED),
        # GeForce RTX 4090: 165 TFLOP/s bf16 with fp32 accumulate (the 330 on the datasheet accumulates in
        # fp16), 24 GB GDDR6X at 1,008 GB/s, no peer-to-peer. torch: 24,563 MiB.
        Hardware("rtx4090", 24563 * MIB, PEAK_FLOPS["RTX 4090"], 0.70, NO_P2P_BUS, ETH_10G, PCIE4, DESKTOP_ADAM,
                 1008e9 * HBM_ACHIEVED),
        # A10G (AWS g5): NVIDIA publishes no A10G datasheet; the A10's 125 TFLOP/s bf16; 24 GB GDDR6 at
        # 600 GB/s. torch: 22,587 MiB.
        Hardware("a10g", 22587 * MIB, PEAK_FLOPS["A10G"], 0.70, PCIE4_BUS, ETH_100G_PER_8, PCIE4, SERVER_ADAM,
                 600e9 * HBM_ACHIEVED),
        # L4: 121 TFLOP/s bf16 dense, 24 GB GDDR6 at 300 GB/s, 72 W (so a lower GEMM efficiency, estimate).
        # torch: nvidia-smi's 23,034 MiB less the ~440 MiB reserve seen on the A10G (estimate).
        Hardware("l4", 22593 * MIB, PEAK_FLOPS["L4"], 0.60, PCIE4_BUS, ETH_100G_PER_8, PCIE4, SERVER_ADAM,
                 300e9 * HBM_ACHIEVED),
        # B200 (HGX): 2.25 PFLOP/s bf16 dense, 180 GB HBM3e at 8 TB/s, NVLink 5, one 400 Gb/s NIC per GPU.
        # torch: 182,631 MiB. Efficiency an estimate (Hopper's).
        Hardware("b200", 182631 * MIB, PEAK_FLOPS["B200"], 0.80, NVLINK5_BUS, IB_400G, PCIE5, SERVER_ADAM,
                 8e12 * HBM_ACHIEVED),
    ]
}

# Device names as NVIDIA reports them ('NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3', 'NVIDIA GeForce
# RTX 4090'), split into words: (table key, words it must have, words it must not have). First match wins.
_NAME_RULES: list[tuple[str, frozenset[str], frozenset[str]]] = [
    ("h100-pcie", frozenset({"h100", "pcie"}), frozenset({"nvl"})),
    ("h100", frozenset({"h100"}), frozenset({"nvl", "pcie"})),  # H100 NVL is another card (94 GB, 400 W)
    ("h200", frozenset({"h200"}), frozenset({"nvl"})),
    ("a100-80gb", frozenset({"a100", "80gb"}), frozenset()),
    ("a100-40gb", frozenset({"a100", "40gb"}), frozenset()),
    ("rtx4090", frozenset({"rtx", "4090"}), frozenset()),
    ("l40s", frozenset({"l40s"}), frozenset()),
    ("a10g", frozenset({"a10g"}), frozenset()),
    ("l4", frozenset({"l4"}), frozenset()),
    ("b200", frozenset({"b200"}), frozenset()),
]
_NOISE_WORDS = frozenset({"nvidia", "geforce", "tesla"})


def known_names() -> str:
    return ", ".join(GPUS)


# GPU types with float8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell), where train.float8 runs.
FLOAT8_GPUS = frozenset({"h200", "h100", "h100-pcie", "l40s", "rtx4090", "l4", "b200"})


def lookup(name: str, memory_bytes: int | None = None) -> Hardware:
    """The table entry for a GPU type or device name, case-insensitive: 'h200', 'NVIDIA H200', 'a100-80gb',
    'NVIDIA A100-SXM4-80GB'. An A100 named without its memory size takes it from `memory_bytes` (the
    device's total memory) when given. Unknown or ambiguous names raise ShardtuneError."""
    words = [w for w in re.split(r"[\s_\-/]+", name.strip().lower()) if w and w not in _NOISE_WORDS]
    for key in ("-".join(words), "".join(words)):
        if key in GPUS:
            return GPUS[key]
    present = set(words)
    for key, needed, excluded in _NAME_RULES:
        if needed <= present and not present & excluded:
            return GPUS[key]
    if "a100" in present:
        if memory_bytes is not None:
            return GPUS["a100-80gb" if memory_bytes > 60 * 2**30 else "a100-40gb"]
        raise ShardtuneError(f"GPU type {name!r} is ambiguous: say a100-80gb or a100-40gb")
    raise ShardtuneError(f"unknown GPU type {name!r}; known types: {known_names()} (device names such as "
                         "'NVIDIA A100-SXM4-80GB' work too)")


def parse_memory(text: str, what: str = "GPU memory", example: str = "80GiB or 141GB") -> int:
    """'80GiB', '80GB', '141 GB', '139.8GiB' -> bytes (GB = 1e9, GiB = 2**30). A bare number is refused:
    its unit would be a guess."""
    if not re.search(r"[a-zA-Z]\s*$", str(text)):
        raise ShardtuneError(f"{what} {text!r}: give a unit, e.g. {example}")
    try:
        value = parse_size(text)
    except ValueError:
        raise ShardtuneError(f"{what} {text!r} is not a size like {example}") from None
    if value <= 0:
        raise ShardtuneError(f"{what} {text!r}: must be more than 0, e.g. {example.split()[0]}")
    return value


def detect() -> Hardware | None:
    """The local GPU's table entry with the memory the driver reports; None without a GPU."""
    from shardtune.launch import local_gpus

    gpus = local_gpus()
    if not gpus:
        return None
    name, total = gpus[0].name, gpus[0].memory_bytes
    try:
        entry = lookup(name, memory_bytes=total)
    except ShardtuneError:
        raise ShardtuneError(f"the local GPU {name!r} is not in the hardware table ({known_names()}); name the "
                             "closest type with --gpu") from None
    return replace(entry, memory_bytes=total, host_memory_bytes=local_host_memory())


def local_host_memory() -> int | None:
    """This machine's physical memory, bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def calibration_path() -> Path:
    """Where `shardtune calibrate` writes and `plan` reads: $SHARDTUNE_CALIBRATION, else
    ~/.cache/shardtune/calibration.json."""
    env = os.environ.get("SHARDTUNE_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "shardtune" / "calibration.json"


# What calibrate writes besides the Hardware fields (not read back into Hardware).
CALIBRATION_META = ("measured_at", "torch", "device_name", "gpus", "method", "not_measured")


def load_calibration(path: str | Path) -> Hardware:
    """A calibration JSON laid over the table entry of its GPU type (its "name"); fields it lacks keep the
    table's values."""
    path = Path(path)
    if not path.is_file():
        raise ShardtuneError(f"calibration file {path} does not exist; run `shardtune calibrate` on the GPU "
                             f"machine (it writes {calibration_path()})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ShardtuneError(f"calibration file {path}: not valid JSON ({err}); run `shardtune calibrate` again") \
            from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ShardtuneError(f"calibration file {path}: no GPU type under \"name\" (e.g. \"h200\"); run "
                             "`shardtune calibrate` again")
    unknown = sorted(set(data) - set(FIELDS) - set(CALIBRATION_META))
    if unknown:
        raise ShardtuneError(f"calibration file {path}: unknown key(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(FIELDS + CALIBRATION_META)}")
    try:
        base = lookup(data["name"])
    except ShardtuneError as err:
        raise ShardtuneError(f"calibration file {path}: {err}") from None
    return replace(base, **{key: _positive(path, key, data[key]) for key in FIELDS[1:] if key in data})


def _positive(path: Path, key: str, value: object) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ShardtuneError(f"calibration file {path}: {key} = {value!r} is not a positive number; run "
                             "`shardtune calibrate` again or remove the key to use the table's value")
    return int(value) if key == "memory_bytes" else float(value)
