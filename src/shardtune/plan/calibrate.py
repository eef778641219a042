"""`shardtune calibrate`: measure this machine's ceilings and write them where `plan` reads them.

Each measurement is a small function of a device and sizes (so those that can run on a CPU are
tested there with tiny sizes). `measure` runs them one after another, records any that fails in
"not_measured" with its error and goes on; the collectives run in torchrun worker processes under
a wall-clock limit, so a stuck NCCL cannot hang the command.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from shardtune.errors import ShardtuneError
from shardtune.plan.hardware import Hardware, calibration_path, detect, load_calibration, lookup

GIB = 2**30
MIB = 2**20
# The torchrun workers that measure collectives read their job from here (output file, sizes).
WORKER_ENV = "SHARDTUNE_CALIBRATE_COLLECTIVES"


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does; warm-up is in seconds so the GPU's clocks ramp up first."""

    matmul_n: int = 8192  # n x n x n bf16 GEMM, 1.1 TFLOP: ~1.4 ms on an H200
    matmul_iters: int = 10  # calls per timed batch; 5 batches
    copy_bytes: int = 2 * GIB  # device-to-device copy, several times any L2
    copy_iters: int = 10
    host_copy_bytes: int = GIB
    host_copy_iters: int = 3
    adam_params: int = 100_000_000  # fp32 parameters stepped by the host AdamW
    adam_steps: int = 4  # each timed alone
    collective_bytes: int = GIB  # the gathered (all-gather) or reduced (reduce-scatter) tensor, bf16
    collective_iters: int = 10
    warmup_s: float = 1.0
    collective_timeout_s: float = 120.0


FULL = Sizes()
QUICK = Sizes(matmul_iters=4, copy_bytes=GIB, copy_iters=4, host_copy_bytes=256 * MIB, host_copy_iters=2,
              adam_params=25_000_000, adam_steps=2, collective_bytes=256 * MIB, collective_iters=4, warmup_s=0.5,
              collective_timeout_s=60.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, iters: int, warmup_s: float,
                     repeats: int = 5) -> float:
    """Seconds per call of fn: the median over `repeats` batches of `iters` back-to-back calls, after
    `warmup_s` seconds of warm-up calls, at least one (CUDA events on a GPU, the wall clock on a CPU). Calls
    run back to back: a GPU idle between single calls drops its clocks (8192^3 GEMMs timed one at a time
    read ~665 TFLOP/s on the H200 here)."""
    end_warmup = time.perf_counter() + warmup_s
    while True:  # at least one call: the first pays for allocations and kernel selection
        fn()
        _sync(device)
        if time.perf_counter() >= end_warmup:
            break
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def matmul_flops(device: torch.device, n: int, iters: int, sustain_s: float,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(burst, sustained) FLOP/s of an n x n x n matrix product (2·n³ FLOPs) on random data (zeros run
    faster on GPUs).

    Burst: one batch of `iters` products after three warm-ups, the way the table's Hopper efficiency was
    measured and the planner's step constants (plan/speed.py) were fitted against it. Sustained: after
    `sustain_s` seconds of products, when a GPU at its power limit has lowered its clocks (H200 here:
    ~790 TFLOP/s burst, 660-690 sustained at 700 W); recorded for comparison."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def fn() -> object:
        return torch.mm(a, b, out=out)

    for _ in range(2):  # with seconds_per_call's own warm-up call: three
        fn()
    burst = seconds_per_call(fn, device, iters, warmup_s=0.0, repeats=1)
    sustained = seconds_per_call(fn, device, iters, warmup_s=sustain_s)
    return 2 * n**3 / burst, 2 * n**3 / sustained


def copy_bandwidth(device: torch.device, nbytes: int, iters: int, warmup_s: float) -> float:
    """Device memory bandwidth, bytes/s: a copy of nbytes counts nbytes read plus nbytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), device, iters, warmup_s)


def host_copy_bandwidth(device: torch.device, nbytes: int, iters: int, warmup_s: float) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of pinned copies, as offload moves states (unpinned on a CPU-only
    machine, where pinning needs an accelerator)."""
    pin = torch.cuda.is_available()
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = seconds_per_call(lambda: dev.copy_(host, non_blocking=pin), device, iters, warmup_s)
    d2h = seconds_per_call(lambda: host.copy_(dev, non_blocking=pin), device, iters, warmup_s)
    return nbytes / h2d, nbytes / d2h


def host_adam_rate(n_params: int, steps: int, impl: str = "torch") -> float:
    """Parameters/s of one AdamW step over n_params fp32 parameters on the host, all cores.

    impl "deepspeed" is DeepSpeedCPUAdam (what DeepSpeed's optimizer offload runs; built on first use),
    "torch" torch.optim.AdamW(foreach=True). The parameters come in 4M-element tensors, like a model's."""
    chunk = 4 * 2**20
    sizes = [chunk] * (n_params // chunk) + ([n_params % chunk] if n_params % chunk else [])
    # Constant values keep denormals (slow on CPUs) out of the moments.
    params = [torch.nn.Parameter(torch.full((s,), 0.01)) for s in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: torch.optim.Optimizer = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    elif impl == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    else:
        raise ValueError(f"impl {impl!r}: expected 'torch' or 'deepspeed'")
    cpu = torch.device("cpu")
    return n_params / seconds_per_call(opt.step, cpu, 1, warmup_s=0.0, repeats=steps)


def deepspeed_cpu_adam_built() -> bool:
    """True when DeepSpeed imports and its CPU Adam op needs no build (installed prebuilt or in the JIT cache)."""
    try:
        import importlib.util

        from deepspeed.ops.op_builder import CPUAdamBuilder
        from torch.utils.cpp_extension import _get_build_directory

        builder = CPUAdamBuilder()
        if importlib.util.find_spec(builder.absolute_name()) is not None:
            return True
        return any(Path(_get_build_directory(builder.name, verbose=False)).glob(f"{builder.name}*.so"))
    except Exception:
        return False


def bus_bandwidth(total_bytes: int, seconds: float, world: int) -> float:
    """NCCL's bus bandwidth for all-gather and reduce-scatter (nccl-tests' busbw): the full tensor's bytes
    over the time, times (world-1)/world, the share each GPU sends over its links; comparable across GPU
    counts and with the link's rate."""
    return total_bytes / seconds * (world - 1) / world


def collective_bandwidth(kind: str, device: torch.device, total_bytes: int, iters: int, warmup_s: float) -> float:
    """Bus bandwidth, bytes/s, of all_gather_single or reduce_scatter_single in bf16 over the default
    process group; total_bytes is the gathered (or the reduced) tensor's size."""
    import torch.distributed as dist

    from shardtune.dist import all_gather_single, reduce_scatter_single

    world = dist.get_world_size()
    numel = max(1, total_bytes // 2 // world) * world
    full = torch.ones(numel, dtype=torch.bfloat16, device=device)
    part = torch.empty(numel // world, dtype=torch.bfloat16, device=device)
    if kind == "all_gather":
        def fn() -> object:
            return all_gather_single(full, part)
    elif kind == "reduce_scatter":
        def fn() -> object:
            return reduce_scatter_single(part, full)
    else:
        raise ValueError(f"kind {kind!r}: expected 'all_gather' or 'reduce_scatter'")
    dist.barrier()
    return bus_bandwidth(numel * 2, seconds_per_call(fn, device, iters, warmup_s), world)


def collectives_worker() -> int:
    """Body of each torchrun process `run_collectives` starts: time both collectives, rank 0 writes the rates."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from shardtune.dist import clean_exit

    job = json.loads(os.environ[WORKER_ENV])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    code = 0
    try:
        if cuda:
            torch.cuda.set_device(device)
        # The timeout lets NCCL's watchdog abort a stuck collective rather than wait for ever.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=job["timeout_s"]),
                                **({"device_id": device} if cuda else {}))
        rates = {kind: collective_bandwidth(kind, device, job["bytes"], job["iters"], job["warmup_s"])
                 for kind in ("all_gather", "reduce_scatter")}
        if dist.get_rank() == 0:
            Path(job["out"]).write_text(json.dumps({**rates, "world": dist.get_world_size(),
                                                    "backend": dist.get_backend()}))
    except Exception:
        traceback.print_exc()
        code = 1
    clean_exit(code)


def run_collectives(gpus: int, sizes: Sizes) -> dict[str, Any]:
    """All-gather and reduce-scatter bus bandwidth on `gpus` local processes (NCCL on GPUs, gloo on a CPU),
    under torchrun as `shardtune train` launches; killed after sizes.collective_timeout_s."""
    from shardtune.launch import LaunchOptions, torchrun_args

    with tempfile.TemporaryDirectory(prefix="shardtune-calibrate-") as tmp:
        out = Path(tmp) / "collectives.json"
        job = {"out": str(out), "bytes": sizes.collective_bytes, "iters": sizes.collective_iters,
               "warmup_s": sizes.warmup_s, "timeout_s": sizes.collective_timeout_s}
        env = {**os.environ, WORKER_ENV: json.dumps(job), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run",
               *torchrun_args(gpus, ["calibrate"], LaunchOptions(nproc=gpus))]
        # A session of its own, so that a timeout can stop torchrun and its workers together.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=sizes.collective_timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise RuntimeError(f"timed out after {sizes.collective_timeout_s:.0f} s") from None
        if proc.returncode != 0 or not out.is_file():
            lines = [line for line in output.splitlines() if line.strip()]
            raise RuntimeError(f"workers exited {proc.returncode}: {lines[-1] if lines else 'no output'}")
        return json.loads(out.read_text())


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def choose_adam(quick: bool) -> tuple[str, str]:
    """Which host AdamW to time: DeepSpeed's CPU Adam (what optimizer offload runs) when DeepSpeed is
    installed; --quick takes it only when it is already built. Returns (impl, why)."""
    try:
        import deepspeed.ops.adam  # noqa: F401
    except Exception:
        return "torch", "DeepSpeed is not installed"
    if deepspeed_cpu_adam_built():
        return "deepspeed", "already built"
    if quick:
        return "torch", "DeepSpeed's CPU Adam is not built yet and --quick does not build it"
    return "deepspeed", "built now, once (30-60 s)"


Step = tuple[str, tuple[str, ...], Callable[[], tuple[dict[str, float], str]]]


def _steps(device: torch.device, sizes: Sizes, base: Hardware, gpus: int, adam_impl: str, quick: bool) -> list[Step]:
    s = sizes

    def matmul() -> tuple[dict[str, float], str]:
        burst, sustained = matmul_flops(device, s.matmul_n, s.matmul_iters, s.warmup_s)
        return ({"matmul_efficiency": burst / base.bf16_flops},
                f"{s.matmul_n}^3 bf16 torch.mm on random data, {s.matmul_iters} back to back after 3 warm-ups: "
                f"{burst / 1e12:.0f} TFLOP/s of the datasheet's {base.bf16_flops / 1e12:.0f}; sustained (after "
                f"{s.warmup_s:g} s, median of 5 batches): {sustained / 1e12:.0f} TFLOP/s")

    def hbm() -> tuple[dict[str, float], str]:
        rate = copy_bandwidth(device, s.copy_bytes, s.copy_iters, s.warmup_s)
        return ({"hbm_bytes_per_s": rate},
                f"{_size(s.copy_bytes)} device copy, bytes read + written, median of 5 batches of {s.copy_iters}")

    def host_copy() -> tuple[dict[str, float], str]:
        h2d, d2h = host_copy_bandwidth(device, s.host_copy_bytes, s.host_copy_iters, s.warmup_s)
        return ({"h2d_bytes_per_s": min(h2d, d2h)},
                f"{_size(s.host_copy_bytes)} pinned copies, the slower direction: host->device "
                f"{h2d / 1e9:.1f} GB/s, device->host {d2h / 1e9:.1f} GB/s")

    def adam() -> tuple[dict[str, float], str]:
        impl, why = choose_adam(quick) if adam_impl == "auto" else (adam_impl, "asked for")
        if impl == "deepspeed":
            try:
                rate = host_adam_rate(s.adam_params, s.adam_steps, "deepspeed")
                return ({"host_adam_params_per_s": rate},
                        f"DeepSpeedCPUAdam ({why}) on {s.adam_params:,} fp32 parameters")
            except Exception as err:
                why = f"DeepSpeedCPUAdam failed: {_one_line(err)}"
        rate = host_adam_rate(s.adam_params, s.adam_steps, "torch")
        return ({"host_adam_params_per_s": rate},
                f"torch AdamW foreach on {s.adam_params:,} fp32 parameters ({why}); DeepSpeed's CPU "
                "Adam is typically faster")

    def collectives() -> tuple[dict[str, float], str]:
        r = run_collectives(gpus, s)
        return ({"intra_node_bus_bytes_per_s": min(r["all_gather"], r["reduce_scatter"])},
                f"{_size(s.collective_bytes)} bf16 over {r['world']} processes ({r['backend']}), bus "
                f"bandwidth, the slower: all-gather {r['all_gather'] / 1e9:.0f} GB/s, reduce-scatter "
                f"{r['reduce_scatter'] / 1e9:.0f} GB/s")

    steps: list[Step] = [("bf16 matmul", ("matmul_efficiency",), matmul),
                         ("device memory copy", ("hbm_bytes_per_s",), hbm),
                         ("pinned host<->device copy", ("h2d_bytes_per_s",), host_copy),
                         ("host AdamW", ("host_adam_params_per_s",), adam)]
    if gpus > 1:
        steps.append(("all-gather / reduce-scatter", ("intra_node_bus_bytes_per_s",), collectives))
    return steps


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB" if nbytes >= GIB else f"{nbytes / MIB:g} MiB"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"


def _progress(message: str) -> None:
    print(f"calibrate: {message}", file=sys.stderr, flush=True)


def measure(device: torch.device, sizes: Sizes, base: Hardware, gpus: int, adam_impl: str = "auto",
            quick: bool = False) -> dict[str, Any]:
    """Every measurement on `device`, laid over `base`: the calibration record (Hardware fields + metadata).
    A measurement that fails keeps the table's value and says why under "not_measured"."""
    record: dict[str, Any] = asdict(base)
    record.pop("host_memory_bytes", None)  # not a GPU ceiling: plan reads the host where it runs
    method: dict[str, str] = {"bf16_flops": "datasheet (metrics/flops.py)",
                              "memory_bytes": "torch.cuda.get_device_properties().total_memory"}
    not_measured: dict[str, str] = {
        "inter_node_bus_bytes_per_s": "calibrate runs on one node: the table's value"}
    if gpus <= 1:
        not_measured["intra_node_bus_bytes_per_s"] = f"{gpus} GPU visible: the table's value"
    for label, keys, run in _steps(device, sizes, base, gpus, adam_impl, quick):
        _progress(f"{label} ...")
        t0 = time.perf_counter()
        try:
            values, how = run()
        except Exception as err:
            for key in keys:
                not_measured[key] = f"{label} failed: {_one_line(err)}"
            _progress(f"{label} failed ({_one_line(err)}); keeping the table's value")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # give the next measurement the whole device
        record.update(values)
        method.update(dict.fromkeys(keys, how))
        _progress(f"{label}: {how} ({time.perf_counter() - t0:.1f} s)")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    record.update(measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), torch=torch.__version__,
                  device_name=device_name, gpus=gpus, method=method, not_measured=not_measured)
    return record


def write_calibration(record: dict[str, Any], path: Path) -> None:
    """Write the record as JSON, atomically (a half-written file never replaces a good one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def _writable(path: Path) -> Path:
    """Check --out before measuring for a minute."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ShardtuneError(f"--out {path}: cannot create its folder ({err.strerror}); choose another path") \
            from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise ShardtuneError(f"--out {path}: not a writable file path; choose another path")
    return path


def _local_hardware(gpu: str | None) -> Hardware:
    if gpu is None:
        hw = detect()
        assert hw is not None  # the caller checked for a GPU
        return hw
    total = torch.cuda.get_device_properties(0).total_memory
    return replace(lookup(gpu, memory_bytes=total), memory_bytes=total)


NO_GPU = ("calibrate needs a CUDA GPU and torch sees none here; run it on the GPU machine (without a calibration "
          "`shardtune plan` uses the datasheet table, see --gpu)")


def calibrate_command(out: str | None, quick: bool, gpu: str | None = None) -> int:
    """`shardtune calibrate`: measure, write the JSON, print the table. Exit 1 when a measurement failed (the
    file is written all the same, with the table's values for it)."""
    from shardtune.launch import under_torchrun

    if under_torchrun() and WORKER_ENV in os.environ:
        return collectives_worker()
    if not torch.cuda.is_available():
        raise ShardtuneError(NO_GPU)
    path = _writable(Path(out) if out else calibration_path())
    base = _local_hardware(gpu)
    gpus = torch.cuda.device_count()
    _progress(f"{torch.cuda.get_device_name(0)} as {base.name}, {gpus} GPU(s), {'quick' if quick else 'full'} run")
    record = measure(torch.device("cuda", 0), QUICK if quick else FULL, base, gpus, quick=quick)
    write_calibration(record, path)
    load_calibration(path)  # it reads back
    print(format_table(record, base, path))
    failed = [key for key, why in record["not_measured"].items() if " failed: " in why]
    return 1 if failed else 0


def _rate(unit: str, scale: float) -> Callable[[float], str]:
    return lambda value: f"{value / scale:,.1f} {unit}"


_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("memory (torch total)", "memory_bytes", _rate("GiB", GIB)),
    ("bf16 matmul efficiency", "matmul_efficiency", lambda v: f"{v:.2f}"),
    ("device memory (copy)", "hbm_bytes_per_s", _rate("TB/s", 1e12)),
    ("host<->device (pinned)", "h2d_bytes_per_s", _rate("GB/s", 1e9)),
    ("host AdamW", "host_adam_params_per_s", _rate("M params/s", 1e6)),
    ("intra-node bus (NCCL)", "intra_node_bus_bytes_per_s", _rate("GB/s", 1e9)),
    ("inter-node bus", "inter_node_bus_bytes_per_s", _rate("GB/s", 1e9)),
]


def format_table(record: dict[str, Any], base: Hardware, path: Path) -> str:
    """What calibrate prints: each ceiling, measured (or why not) beside the table's value."""
    lines = [f"{record['device_name']} ({record['name']}), {record['gpus']} GPU(s), torch {record['torch']} -> "
             f"{path}", f"{'':<26}{'measured':<24}table"]
    for label, key, fmt in _ROWS:
        value = record[key]
        shown = "not measured" if key in record["not_measured"] else fmt(value)
        if key == "matmul_efficiency" and key not in record["not_measured"]:
            shown += f" ({value * base.bf16_flops / 1e12:,.0f} TFLOP/s)"
        lines.append(f"{label:<26}{shown:<24}{fmt(getattr(base, key))}")
    return "\n".join(lines)
