"""LoRA / QLoRA throughput and memory: shardtune vs Hugging Face Trainer + PEFT (+ bitsandbytes).

    python bench/peft_bench.py --size 8b --runs lora:1,qlora:1,lora:2,qlora:2 --baselines lora:1,qlora:1
    python bench/peft_bench.py --size 8b --runs lora:1,lora:1:lg --baselines lora:1,lora:1:lg --steps 40
    python bench/peft_bench.py --size tiny --runs lora:2,qlora:2 --baselines lora:1     # CPU plumbing

A run is METHOD:NPROC[:c][:lg|:lgl][:sel][:sf][:dir][:ch] (c: parallel.compile=true, each decoder block compiled; lg:
Liger-Kernel, model.liger=true for shardtune, HF_LIGER=1 (use_liger_kernel=True) for the baseline; lgl:
model.liger=loss, Liger's fused linear + cross-entropy only, shardtune runs only; sel: shardtune's selective
activation checkpointing instead of full; sf: parallel.shard_frozen=false, the frozen base kept out of FSDP2; dir:
parallel.one_gpu=direct, one process without FSDP2; ch: model.liger_chunk=1024, the fused loss in 1024-token chunks).
Every step is timed (shardtune log.every=1); rows are the median over the steps after --warmup with min-max.
shardtune: the preset of --size, long random text (full rows), seq 2048,
micro-batch 2, bf16, activation checkpointing, zero3, r=16 on all attention + MLP projections.
Baselines: bench/hf_trainer_baseline.py (HF Trainer + PEFT, gradient checkpointing; QLoRA through
bitsandbytes NF4 + double quantisation). Prints a table last; ratios are against the baseline of
the same method and GPU count measured in the same call.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"tiny": ("tiny-llama", 64, "fp32"), "1b": ("llama-3.2-1b", 2048, "bf16"),
           "8b": ("llama-3-8b", 2048, "bf16"), "70b": ("llama-3-70b", 2048, "bf16")}


STEP_FIELDS = ("step", "step_time_s", "host_s", "data_s", "gc_s", "alloc_retries", "gpu_sm_clock_mhz",
               "gpu_clock_events", "gpu_power_w", "gpu_util_pct", "peak_mem_gib")

# Run flags that are shardtune overrides (the run's tag and label name them).
FLAG_OVERRIDES = {"sf": "parallel.shard_frozen=false", "dir": "parallel.one_gpu=direct", "ch": "model.liger_chunk=1024"}


def shardtune_run(method: str, nproc: int, size: str, data: Path, out: Path, steps: int, mbs: int,
                  compile_blocks: bool = False, liger: bool | str = False, warmup: int = 10, ac: str = "full",
                  extra: tuple[str, ...] = (), knobs: tuple[str, ...] = ()) -> dict:
    preset, seq, prec = PRESETS[size]
    tag = f"{method}_{nproc}" + ("_c" if compile_blocks else "") + \
        {False: "", True: "_lg", "loss": "_lgl"}[liger] + \
        ("_sel" if ac == "selective" else "") + "".join(f"_{k}" for k in knobs)
    extra = (*extra, *(FLAG_OVERRIDES[k] for k in knobs))
    run_dir = out / f"st_{tag}"
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench" / "bench.yaml"), "--nproc", str(nproc),
           f"model.preset={preset}", f"data.train_file={data}", "data.eval_fraction=0", f"train.seq_len={seq}",
           f"train.micro_batch_size={mbs}", f"train.precision={prec}", f"train.max_steps={steps}", "log.every=1",
           "log.progress=false", "checkpoint.save_final=false", "checkpoint.at_end=false",
           "parallel.strategy=zero3", f"parallel.activation_checkpointing={ac}", f"peft.method={method}",
           "peft.r=16", "peft.alpha=32", f"train.output_dir={run_dir}", f"parallel.compile={compile_blocks}",
           f"model.liger={str(liger).lower()}", *extra]
    proc = _run(cmd)
    (out / f"st_{tag}.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    label = _label(method, compile_blocks, liger) + ("+sel" if ac == "selective" else "")
    result = {"who": "shardtune", "method": label + "".join(f"+{k}" for k in knobs), "nproc": nproc,
              "rc": proc.returncode}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if '"loss"' in x]
        timed = [r for r in recs if r.get("step", 0) > warmup]
        if timed:
            tps = [r["tokens_per_sec_per_device"] for r in timed]
            result.update(tokens_per_s_per_gpu=statistics.median(tps), tokens_per_s_per_gpu_min=min(tps),
                          tokens_per_s_per_gpu_max=max(tps), steps_timed=len(tps),
                          peak_alloc_gib=max(r["peak_mem_gib"] for r in recs),
                          # the timed steps' own (each record its interval's peak): without compile's first step
                          peak_alloc_steady_gib=max(r["peak_mem_gib"] for r in timed),
                          peak_reserved_gib=max(r["peak_reserved_gib"] for r in recs),
                          # each timed step's record, for where a slow step's time went (the step swings)
                          steps=[{k: r[k] for k in STEP_FIELDS if k in r} for r in timed])
    return result


def _label(method: str, compile_blocks: bool, liger: bool | str) -> str:
    return method + ("+compile" if compile_blocks else "") + {False: "", True: "+liger", "loss": "+ligerloss"}[liger]


def baseline_run(method: str, nproc: int, size: str, out: Path, steps: int, mbs: int, liger: bool = False,
                 warmup: int = 10) -> dict:
    seq = PRESETS[size][1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "bench" / "hf_trainer_baseline.py"), "--mode", method, "--size", size, "--seq", str(seq),
           "--mbs", str(mbs), "--steps", str(steps), "--warmup", str(warmup)]
    proc = _run(cmd, env={**os.environ, "HF_LIGER": "1" if liger else "0"})
    (out / f"hf_{_label(method, False, liger)}_{nproc}.log").write_text(" ".join(cmd) + "\n" + proc.stdout
                                                                         + proc.stderr)
    result = {"who": "hf_peft", "method": _label(method, False, liger), "nproc": nproc, "rc": proc.returncode}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if lines:
        r = json.loads(lines[-1][len("RESULT "):])
        result.update({k: r.get(k) for k in ("tokens_per_s_per_gpu", "tokens_per_s_per_gpu_min",
                                             "tokens_per_s_per_gpu_max", "steps_timed", "peak_alloc_gib",
                                             "peak_alloc_steady_gib", "peak_reserved_gib", "steps")})
    return result


TIMEOUT = 300.0  # per run (--timeout): a stuck run is recorded as rc 124 and the rest go on


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired as err:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return subprocess.CompletedProcess(cmd, 124, text(err.stdout), text(err.stderr) + "\nTIMEOUT")


def _pairs(spec: str) -> list[tuple[str, int, bool, bool | str, str, tuple[str, ...]]]:
    """'lora:1,qlora:2:c:lg:sel:dir' -> [('lora', 1, False, False, 'full', ()), ('qlora', 2, True, True,
    'selective', ('dir',))] (c: compile each block; lg: Liger-Kernel; lgl: its fused loss only; sel: selective
    activation checkpointing; sf, dir, ch: FLAG_OVERRIDES; the last four shardtune only)."""
    out = []
    for item in filter(None, spec.split(",")):
        method, n, *flags = item.split(":")
        liger = "loss" if "lgl" in flags else "lg" in flags
        knobs = tuple(k for k in FLAG_OVERRIDES if k in flags)
        out.append((method, int(n), "c" in flags, liger, "selective" if "sel" in flags else "full", knobs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=PRESETS, default="tiny")
    ap.add_argument("--runs", default="lora:1,qlora:1")
    ap.add_argument("--baselines", default="lora:1,qlora:1")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the whole script (0: none); a run "
                    "starts only while more than --min-run seconds remain")
    ap.add_argument("--min-run", type=float, default=90.0)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--out", default="/tmp/shardtune_peft")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per run")
    ap.add_argument("--first", choices=["shardtune", "baselines"], default="shardtune")
    ap.add_argument("--extra", default="", help="overrides added to every shardtune run, space-separated "
                    "with shell quoting, e.g. \"log.memory_snapshot=[3,3] 'log.profile={start: 5, steps: 2}'\" "
                    "(steps inside the warm-up)")
    args = ap.parse_args()
    globals()["TIMEOUT"] = args.timeout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "long.jsonl"
    seq = PRESETS[args.size][1]
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_long_text.py"), str(data), "--n", "256",
                    "--chars", str(seq + seq // 8 + 32), "--min-tokens", str(seq)], check=True, capture_output=True)
    results = []
    jobs = ([("baseline", *job) for job in _pairs(args.baselines)] +
            [("shardtune", *job) for job in _pairs(args.runs)])
    if args.first == "shardtune":
        jobs.sort(key=lambda j: j[0] != "shardtune")
    start = time.monotonic()
    for who, method, n, compile_blocks, liger, ac, knobs in jobs:
        left = args.budget - (time.monotonic() - start)
        if args.budget and left < args.min_run:
            print(f"skipped {who} {_label(method, compile_blocks, liger)}: {left:.0f} s of the budget left")
            continue
        if args.budget:
            globals()["TIMEOUT"] = min(args.timeout, left - 10)
        if who == "baseline":
            results.append(baseline_run(method, n, args.size, out, args.steps, args.mbs, liger, args.warmup))
        else:
            results.append(shardtune_run(method, n, args.size, data, out, args.steps, args.mbs, compile_blocks,
                                         liger, args.warmup, ac, tuple(shlex.split(args.extra)), knobs))
        print(json.dumps(results[-1]), flush=True)
        # Written after every run: a call that runs out of time still leaves what it measured.
        (out / "peft_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    print_table(results, args.size, seq, args.mbs, args.steps, args.warmup)


def print_table(results: list[dict], size: str, seq: int, mbs: int, steps: int, warmup: int) -> None:
    """Each row against HF + PEFT and HF + PEFT + Liger of the same method and GPU count (same call)."""
    base = {(r["method"], r["nproc"]): r.get("tokens_per_s_per_gpu") for r in results if r["who"] == "hf_peft"}

    def ratio(r: dict, liger: bool) -> str:
        method = r["method"].split("+")[0] + ("+liger" if liger else "")
        tps, ref = r.get("tokens_per_s_per_gpu"), base.get((method, r["nproc"]))
        return f"{tps / ref:.2f}" if tps and ref else "-"

    print(f"\n{size}: seq {seq}, micro-batch {mbs}, activation checkpointing, LoRA r=16 on all projections; "
          f"median tokens/s/GPU over steps {warmup + 1}-{steps} (min-max)")
    print("| who | method | GPUs | rc | tokens/s/GPU (min-max) | vs HF+PEFT | vs HF+PEFT+Liger | peak alloc GiB "
          "| peak reserved GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        tps = r.get("tokens_per_s_per_gpu") or 0
        spread = (f" ({r['tokens_per_s_per_gpu_min']:,.0f}-{r['tokens_per_s_per_gpu_max']:,.0f})"
                  if r.get("tokens_per_s_per_gpu_min") else "")
        print(f"| {r['who']} | {r['method']} | {r['nproc']} | {r['rc']} | {tps:,.0f}{spread} | {ratio(r, False)} | "
              f"{ratio(r, True)} | {r.get('peak_alloc_gib') or 0:.1f} | {r.get('peak_reserved_gib') or 0:.1f} |")

    print_step_spread(results)


def print_step_spread(results: list[dict]) -> None:
    """Per shardtune row: the median step and its slowest and fastest steps, with where their time went."""
    for r in results:
        steps = sorted(r.get("steps") or [], key=lambda x: x["step_time_s"])
        if len(steps) < 3:
            continue
        med = statistics.median(x["step_time_s"] for x in steps)
        print(f"\n{r['method']}: median step {med * 1e3:.1f} ms; slowest and fastest "
              "(ms, host ms, data ms, gc ms, SM MHz, clock events):")
        for x in (*steps[-3:][::-1], *steps[:2]):
            print(f"  step {x['step']}: {x['step_time_s'] * 1e3:.1f} ({x['step_time_s'] / med - 1:+.1%}), "
                  f"{x.get('host_s', 0) * 1e3:.1f}, {x.get('data_s', 0) * 1e3:.2f}, {x.get('gc_s', 0) * 1e3:.2f}, "
                  f"{x.get('gpu_sm_clock_mhz')}, {x.get('gpu_clock_events')}"
                  + (f", alloc retries {x['alloc_retries']}" if x.get("alloc_retries") else ""))


if __name__ == "__main__":
    main()
