"""The longest sequence one GPU trains (issue 17): 8B QLoRA, micro-batch 1, one sequence of SEQ tokens per step.

    python3 bench/long_context.py --seqs 131072,327680 --runs offload,plain --steps 3 --out $OUT   (device)
    python3 bench/long_context.py --preset tiny-llama --seqs 256,512 --steps 2 --out /tmp/lc        (CPU plumbing)

Each run is `python3 -m shardtune train bench/bench.yaml` with the llama-3.1-8b preset (131,072 positions; past
that, model.max_position_embeddings is raised with the preset's RoPE scaling kept), QLoRA, full activation
checkpointing, Liger's fused loss (`model.liger=loss`: the logits are never materialised), and one text of at
least SEQ tokens per step; `offload` adds parallel.activation_offload, `compile` parallel.compile (the checkpoint
inside the compiled blocks: auto's choice without the offload), `compile_around` with the checkpoint around them,
`offload_compile` both (auto: around; without FSDP2 since call 139, as parallel.one_gpu: auto runs the offload),
`offload_inside` both with the checkpoint inside the compiled blocks under FSDP2, and `offload_direct` that without
FSDP2 (parallel.one_gpu=direct), `offload_budget` the offload of compiled blocks
without a checkpoint under activation_memory_budget 0.3, `offload_tiled` and `offload_compile_tiled` the offload with
each block's MLP in 8,192-token tiles (parallel.tiled_mlp), eager and compiled.
`--hf` adds Hugging Face Trainer + PEFT + bitsandbytes + Liger (bench/hf_trainer_baseline.py --mode qlora,
HF_LIGER=1) at the same lengths. A run that
fails (out of memory) ends that variant's doubling: the longest length that trained is the result. Prints, last,
a table of peak memory, tokens/s and the planner's prediction per run; raw logs and rows go to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"plain": [], "offload": ["parallel.activation_offload=true"],
            # compiled blocks (QLoRA's fastest at 2,048 tokens); with the offload since the twenty-fourth session
            "compile": ["parallel.compile=true"],  # auto: the checkpoint inside the blocks without the offload
            "compile_around": ["parallel.compile=true", "parallel.checkpoint_in_compile=false"],
            "offload_compile": ["parallel.activation_offload=true", "parallel.compile=true"],
            # the checkpoint inside the compiled blocks with the offload (allowed since the thirty-fifth session):
            # less recompute, ~3.5 x p x f bytes per token more in backward (auto keeps it around with the offload);
            # under FSDP2, as parallel.one_gpu: auto ran it until call 138
            "offload_inside": ["parallel.activation_offload=true", "parallel.compile=true",
                               "parallel.checkpoint_in_compile=true", "parallel.one_gpu=fsdp2"],
            # the same without FSDP2 (call 137: FSDP2's speed, 1.0 GiB lower; auto's choice for LoRA / QLoRA since)
            "offload_direct": ["parallel.activation_offload=true", "parallel.compile=true",
                               "parallel.checkpoint_in_compile=true", "parallel.one_gpu=direct"],
            # no checkpoint, the compiled blocks' saved tensors under a memory budget all on the host (what
            # plan/search.py leaves out at length: 100+ GiB a step over PCIe; measured only at 2,048 tokens)
            "offload_budget": ["parallel.activation_offload=true", "parallel.compile=true",
                               "parallel.activation_checkpointing=none", "parallel.activation_memory_budget=0.3"],
            # each block's MLP in 8,192-token tiles (parallel.tiled_mlp, forty-seventh session): the recomputed
            # block's working set without the MLP's; eager, and compiled (the checkpoint around, the tiles eager)
            "offload_tiled": ["parallel.activation_offload=true", "parallel.tiled_mlp=8192"],
            "offload_compile_tiled": ["parallel.activation_offload=true", "parallel.compile=true",
                                      "parallel.tiled_mlp=8192"]}


def run_overrides(variant: str, seq: int, preset: str, positions: int, data: Path | str, steps: int) -> list[str]:
    """The overrides of bench/bench.yaml one shardtune run takes (tests/unit/test_bench_variants.py checks each)."""
    longer = [] if seq <= positions else [f"model.max_position_embeddings={seq}"]
    liger = ["model.liger=loss"] if preset != "tiny-llama" else []
    return [f"model.preset={preset}", f"data.train_file={data}", "data.packing=false", f"train.seq_len={seq}",
            "train.micro_batch_size=1", f"train.max_steps={steps}", "log.every=1", "peft.method=qlora",
            "parallel.strategy=zero3", "parallel.activation_checkpointing=full", *liger, *longer, *VARIANTS[variant]]


def shardtune_run(variant: str, seq: int, args: argparse.Namespace, data: Path, log) -> dict:
    out = Path(args.work) / f"{variant}-{seq}"
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench/bench.yaml"),
           *run_overrides(variant, seq, args.preset, args.positions, data, args.steps),
           "--output-dir", str(out), "--force"]
    # A fresh folder per run: one holding an earlier finished run is refused (exit 2), and its metrics were then read
    # as this run's (call 114, bench/RESULTS.md thirty-sixth session).
    shutil.rmtree(out, ignore_errors=True)
    # recompiles logged: whether a slow early step compiled again (step 2 with the checkpoint inside, call 115)
    row = _run(cmd, {"TORCH_LOGS": "recompiles"}, args.timeout, log, f"shardtune {variant} {seq}")
    try:
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        plan = json.loads((out / "plan.json").read_text())["chosen"]
    except (OSError, json.JSONDecodeError, KeyError):
        return row
    train = [r for r in records if "tokens_per_sec_per_device" in r and not r.get("eval")]
    if train:
        row.update(peak_gib=max(r["peak_mem_gib"] for r in train), steps=train[-1]["step"],
                   tokens_per_s=train[-1]["tokens_per_sec_per_device"],
                   # every step's seconds and its garbage collection's: what a slow early step spent
                   step_s=[round(r.get("step_time_s", 0.0), 2) for r in train],
                   gc_s=[round(r.get("gc_s", 0.0), 2) for r in train],
                   alloc_retries=[r.get("alloc_retries", 0) for r in train])
    row.update(pred_gib=plan["memory_gib"]["allocated"], pred_host_gib=plan["host_memory_gib"],
               pred_tokens_per_s=plan["tokens_per_sec_per_gpu"])
    return row


def hf_run(seq: int, args: argparse.Namespace, log) -> dict:
    cmd = [sys.executable, str(ROOT / "bench/hf_trainer_baseline.py"), "--mode", "qlora", "--size", "8b", "--seq",
           str(seq), "--mbs", "1", "--steps", str(args.steps), "--warmup", "1"]
    row = _run(cmd, {"HF_LIGER": "1"}, args.timeout, log, f"hf {seq}")
    for line in row.pop("tail", "").splitlines():  # the baseline prints "RESULT {json}" with its numbers
        if line.startswith("RESULT "):
            with contextlib.suppress(json.JSONDecodeError):
                row.update(json.loads(line.removeprefix("RESULT ")))
    return row


def _run(cmd: list[str], env: dict[str, str], timeout: float, log, label: str) -> dict:
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, text = 124, f"timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    log.write(f"===== {label}: {' '.join(cmd)}\n{text[-8000:]}\n")
    log.flush()
    oom = "out of GPU memory" in text or "CUDA out of memory" in text or "OutOfMemoryError" in text
    return {"rc": rc, "oom": oom, "wall_s": round(time.time() - start, 1), "tail": text[-3000:],
            "recompiles": text.count("Recompiling function")}


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="65536,131072,262144,327680")
    ap.add_argument("--runs", default="offload,plain", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--hf", action="store_true", help="also Hugging Face Trainer + PEFT + bitsandbytes + Liger")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--positions", type=int, default=131072, help="the preset's max_position_embeddings")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps a run; tokens/s is the last one's (with the checkpoint inside the compiled blocks, "
                         "step 2 still carried a one-time cost on an H100: 2,884 tokens/s against 6,697-6,821 in "
                         "steps 3-4 at 32,768 tokens, call 115)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per run")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for everything; later runs are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/long_context"))
    ap.add_argument("--work", default="/tmp/long_context_runs")
    args = ap.parse_args()
    out, seqs = Path(args.out), [int(s) for s in args.seqs.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    data = Path(args.work) / f"text-{max(seqs)}.jsonl"
    if not data.exists():  # about one token per character with the bundled tokenizer
        subprocess.run([sys.executable, str(ROOT / "bench/make_long_text.py"), str(data), "--n", "4", "--chars",
                        str(max(seqs) + 64), "--min-tokens", str(max(seqs) + 1)], check=True)
    start, rows = time.time(), []
    plans = [(v, s) for v in args.runs.split(",") if v for s in seqs] + ([("hf", s) for s in seqs] if args.hf else [])
    failed: set[str] = set()
    with open(out / "logs.txt", "a") as log, open(out / "results.jsonl", "a") as res:
        for variant, seq in plans:
            if variant in failed:
                continue  # a shorter length already failed: doubling stops there
            left = args.budget - (time.time() - start)
            if left < 60:
                print(f"skip {variant} {seq}: budget", flush=True)
                continue
            args.timeout = min(args.timeout, left)
            row = hf_run(seq, args, log) if variant == "hf" else shardtune_run(variant, seq, args, data, log)
            row = {"variant": variant, "seq": seq, **{k: v for k, v in row.items() if k != "tail"}}
            if row["rc"] != 0:
                failed.add(variant)
            rows.append(row)
            res.write(json.dumps(row) + "\n")
            res.flush()
            print(json.dumps(row), flush=True)
    lines = ["| run | seq | rc | peak GiB (pred) | host GiB pred | tokens/s (pred) |", "|---|---|---|---|---|---|"]
    for r in rows:
        peak, tps = r.get("peak_gib", r.get("peak_alloc_gib")), r.get("tokens_per_s", r.get("tokens_per_sec"))
        lines.append(f"| {r['variant']} | {r['seq']:,} | {r['rc']}{' OOM' if r['oom'] else ''} | {_num(peak, 1)} "
                     f"({r.get('pred_gib', '-')}) | {r.get('pred_host_gib', '-')} | {_num(tps, 0)} "
                     f"({r.get('pred_tokens_per_s', '-')}) |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
