"""Planner accuracy: predicted vs measured peak memory and tokens/s through the real CLI, one GPU.

    python3 bench/planner_accuracy.py --matrix a --out $OUT      (device; .whl installed on PYTHONPATH)
    python3 bench/planner_accuracy.py --matrix tiny --out /tmp/pa (CPU plumbing check)
    python3 bench/planner_accuracy.py --pick 1b-s4096,8b-lora --out $OUT   (the pick: see PICKS)

Each row runs `python3 -m shardtune train bench/bench.yaml ...` (random-init shape, long random text so every
row is full, log every 2 steps, --force so a run the planner refuses is still measured), then reads the run's
plan.json (the planner's prediction, written by the run itself) and metrics.jsonl: measured peak allocated /
reserved = max over records, tokens/s per GPU = median of the records after step WARMUP. The host memory of a
run is the largest sum of VmRSS over its processes, sampled every 0.5 s. Writes results.jsonl and table.md to
--out and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_B = ["model.preset=llama-3.2-1b"]
EIGHT_B = ["model.preset=llama-3-8b"]
# name -> (scenario, overrides). A scenario groups rows that are alternatives for the same job (the pick test).
MATRICES: dict[str, list[tuple[str, str, list[str]]]] = {
    "a": [
        ("1b-zero2-mb4", "1b-s2048", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4"]),
        ("1b-zero3-mb4", "1b-s2048", [*ONE_B, "parallel.strategy=zero3", "train.micro_batch_size=4"]),
        ("1b-ddp-mb4", "1b-s2048", [*ONE_B, "parallel.strategy=ddp", "train.micro_batch_size=4"]),
        ("1b-zero2-mb4-ac", "1b-s2048", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4",
                                          "parallel.activation_checkpointing=full"]),
        ("1b-zero2-mb8-ac", "1b-s2048-mb8", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=8",
                                              "parallel.activation_checkpointing=full"]),
        ("1b-zero3-mb2-s4096", "1b-s4096", [*ONE_B, "parallel.strategy=zero3", "train.micro_batch_size=2",
                                             "train.seq_len=4096"]),
        ("1b-zero2-mb4-8bit", "1b-8bit", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4",
                                           "optim.name=adamw8bit"]),
        ("1b-zero2-mb4-compile", "1b-compile", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4",
                                                 "parallel.compile=true"]),
        ("1b-zero3-mb8-compile-ac", "1b-compile-mb8",
         [*ONE_B, "parallel.strategy=zero3", "train.micro_batch_size=8", "parallel.compile=true",
          "parallel.activation_checkpointing=full"]),
    ],
    "b": [
        ("8b-lora-mb2-ac", "8b-lora", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                       "train.micro_batch_size=2", "parallel.activation_checkpointing=full"]),
        ("8b-lora-mb4-ac", "8b-lora-mb4", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                           "train.micro_batch_size=4", "parallel.activation_checkpointing=full"]),
        ("8b-qlora-mb2-ac", "8b-qlora", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                         "train.micro_batch_size=2", "parallel.activation_checkpointing=full"]),
        ("1b-ds-zero2-mb4", "1b-s2048", [*ONE_B, "parallel.backend=deepspeed", "parallel.strategy=zero2",
                                         "train.micro_batch_size=4"]),
        ("1b-ds-zero3-oo-mb4", "1b-offload", [*ONE_B, "parallel.backend=deepspeed", "parallel.strategy=zero3",
                                              "parallel.offload=optimizer", "train.micro_batch_size=4"]),
    ],
    # Held out from the fit of the planner's constants (rows a and b were fitted), plus the planner's own pick.
    "c": [
        ("1b-auto", "1b-auto", [*ONE_B, "parallel.strategy=auto", "train.micro_batch_size=auto"]),
        ("1b-zero3-mb8-ac", "1b-s2048-mb8", [*ONE_B, "parallel.strategy=zero3", "train.micro_batch_size=8",
                                             "parallel.activation_checkpointing=full"]),
        ("1b-zero2-mb2", "1b-mb2", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=2"]),
        ("1b-ds-zero3-mb4", "1b-s2048", [*ONE_B, "parallel.backend=deepspeed", "parallel.strategy=zero3",
                                         "train.micro_batch_size=4"]),
        ("8b-qlora-mb4-ac", "8b-qlora-mb4", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                             "train.micro_batch_size=4", "parallel.activation_checkpointing=full"]),
        ("1b-ds-zero3-oo-mb4", "1b-offload", [*ONE_B, "parallel.backend=deepspeed", "parallel.strategy=zero3",
                                              "parallel.offload=optimizer", "train.micro_batch_size=4"]),
    ],
    # Liger (model.liger) rows, measured by bench/table1.sh and bench/table2.sh on 2026-12-02.
    "d": [
        ("1b-zero2-mb4-compile-liger", "1b-compile", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4",
                                                      "parallel.compile=true", "model.liger=true"]),
        ("1b-zero2-mb4-compile-ligerloss", "1b-compile", [*ONE_B, "parallel.strategy=zero2",
                                                          "train.micro_batch_size=4", "parallel.compile=true",
                                                          "model.liger=loss"]),
        ("1b-zero2-mb4-liger", "1b-s2048", [*ONE_B, "parallel.strategy=zero2", "train.micro_batch_size=4",
                                            "model.liger=true"]),
        ("8b-lora-mb2-ac-liger", "8b-lora", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                             "train.micro_batch_size=2", "parallel.activation_checkpointing=full",
                                             "model.liger=true"]),
    ],
    # Measured by bench/table1.sh and bench/table2.sh on 2026-12-02 (second session): QLoRA with Liger, selective
    # checkpointing, ddp on one GPU.
    "e": [
        ("8b-qlora-mb2-ac-liger", "8b-qlora", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                               "train.micro_batch_size=2", "parallel.activation_checkpointing=full",
                                               "model.liger=true"]),
        ("8b-qlora-mb2-ac-compile-liger", "8b-qlora", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                                       "train.micro_batch_size=2", "parallel.compile=true",
                                                       "parallel.activation_checkpointing=full", "model.liger=true"]),
        ("8b-lora-mb2-sel-liger", "8b-lora", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                              "train.micro_batch_size=2",
                                              "parallel.activation_checkpointing=selective", "model.liger=true"]),
        ("1b-ddp-mb4-compile-ligerloss", "1b-compile", [*ONE_B, "parallel.strategy=ddp", "train.micro_batch_size=4",
                                                        "parallel.compile=true", "model.liger=loss"]),
    ],
    # Measured by bench/table2.sh on 2026-12-02 (third session): LoRA / QLoRA with compiled blocks and Liger's
    # fused loss only (what model.liger: auto takes under parallel.compile).
    "f": [
        ("8b-qlora-mb2-ac-compile-ligerloss", "8b-qlora", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                                           "train.micro_batch_size=2", "parallel.compile=true",
                                                           "parallel.activation_checkpointing=full",
                                                           "model.liger=loss"]),
        ("8b-lora-mb2-ac-compile-ligerloss", "8b-lora", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                                         "train.micro_batch_size=2", "parallel.compile=true",
                                                         "parallel.activation_checkpointing=full",
                                                         "model.liger=loss"]),
    ],
    # 2026-12-04, after the planner learned LoRA zero2's gathered base and the adapters' matmuls under selective
    # checkpointing: rows neither change was fitted on.
    "g": [
        ("8b-qlora-mb4-sel", "8b-qlora-sel", [*EIGHT_B, "peft.method=qlora", "parallel.strategy=zero3",
                                              "train.micro_batch_size=4",
                                              "parallel.activation_checkpointing=selective"]),
        ("8b-lora-zero3-mb2", "8b-lora-noac", [*EIGHT_B, "peft.method=lora", "parallel.strategy=zero3",
                                               "train.micro_batch_size=2"]),
    ],
    # 2026-12-04 (sixteenth session), bench/table2.sh and peft_bench.py --size 70b: the frozen base kept whole
    # (parallel.shard_frozen=false; since then what `auto` does on one process).
    "h": [
        (f"{size}-{method}-mb2-ac-compile-ligerloss-sf", f"{size}-{method}",
         [f"model.preset=llama-3-{size[:-1]}b", f"peft.method={method}", "parallel.strategy=zero3",
          "train.micro_batch_size=2", "parallel.compile=true", "parallel.activation_checkpointing=full",
          "model.liger=loss", "parallel.shard_frozen=false"])
        for size, method in (("8b", "lora"), ("8b", "qlora"), ("70b", "qlora"))
    ],
    "tiny": [
        ("tiny-zero2", "tiny", ["model.preset=tiny-llama", "parallel.strategy=zero2", "train.micro_batch_size=2",
                                "train.seq_len=256"]),
        ("tiny-zero3-ac", "tiny", ["model.preset=tiny-llama", "parallel.strategy=zero3", "train.micro_batch_size=2",
                                   "train.seq_len=256", "parallel.activation_checkpointing=full"]),
    ],
}


# Pick scenarios (--pick): a job with strategy and micro-batch left to `auto`; the planner's pick is run next to
# the best candidate of another (backend, offload, checkpointing) family and the pick's own family one micro-batch
# size down, and the pick is right when it measures fastest. A knob a scenario sets is kept by every row.
PICKS: dict[str, list[str]] = {
    "1b-s4096": [*ONE_B, "train.seq_len=4096"],
    "1b-compile": [*ONE_B, "parallel.compile=true"],
    "1b-8bit": [*ONE_B, "optim.name=adamw8bit"],
    "1b-deepspeed": [*ONE_B, "parallel.backend=deepspeed"],
    "1b-ac-full": [*ONE_B, "parallel.activation_checkpointing=full"],
    "8b-lora": [*EIGHT_B, "peft.method=lora"],
    "8b-qlora": [*EIGHT_B, "peft.method=qlora"],
    # Long rows: attention is most of the step (priced at its own rate since 2026-12-04) and the candidates
    # trade checkpointing for micro-batch.
    "1b-s16384": [*ONE_B, "train.seq_len=16384"],
}
KNOBS = ("backend", "strategy", "offload", "activation_checkpointing", "activation_offload", "shard_frozen",
         "micro_batch_size")
FAMILY = ("backend", "offload", "activation_checkpointing", "activation_offload")


def pick_rows(scenario: str, overrides: list[str], data: Path) -> list[tuple[str, str, list[str]]]:
    """(name, scenario, overrides) of the pick and its alternatives, from `shardtune plan --json` on this GPU."""
    cmd = [sys.executable, "-m", "shardtune", "plan", str(ROOT / "bench/bench.yaml"), f"data.train_file={data}",
           *overrides, "parallel.strategy=auto", "train.micro_batch_size=auto", "--json"]
    plan = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    pick = plan["pick"]
    if pick is None:
        return []
    fixed = {k.split("=")[0].split(".")[-1]: k.split("=")[1] for k in overrides if k.startswith("parallel.")}
    usable = sorted((c for c in plan["candidates"] if c["fits"] and c["fits_host"]
                     and all(str(c.get(k, v)) == v for k, v in fixed.items())),
                    key=lambda c: -c["tokens_per_sec_per_gpu"])
    other = next((c for c in usable if any(c[k] != pick[k] for k in FAMILY)), None)
    smaller = next((c for c in usable if all(c[k] == pick[k] for k in KNOBS[:-1])
                    and c["micro_batch_size"] < pick["micro_batch_size"]), None)
    rows = []
    for role, c in (("pick", pick), ("alt", other), ("alt-mb", smaller)):
        if c is not None:
            knobs = [f"parallel.{k}={str(c[k]).lower()}" for k in KNOBS[:-1]] + \
                [f"train.micro_batch_size={c['micro_batch_size']}"]
            name = f"{scenario}-{role}-{c['backend']}-{c['strategy']}-{c['offload']}-{c['activation_checkpointing']}" \
                   f"{'-host' if c['activation_offload'] else ''}-mb{c['micro_batch_size']}"
            rows.append((name, f"pick-{scenario}", [*overrides, *knobs]))
    return rows


def pick_table(results: list[dict]) -> list[str]:
    lines = ["| scenario | pick (pred tok/s) | measured tok/s: pick / alternatives | pick fastest? |",
             "|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in results if r["scenario"].startswith("pick-")):
        rows = [r for r in results if r["scenario"] == scenario]
        pick = next((r for r in rows if "-pick-" in r["name"]), None)
        if pick is None or "meas_tps" not in pick:
            lines.append(f"| {scenario} | {pick and pick['name']} | pick not measured (rc {pick and pick['rc']}) | – |")
            continue
        alts = [r for r in rows if r is not pick and "meas_tps" in r]
        best = max([pick, *alts], key=lambda r: r["meas_tps"])
        alt_text = "; ".join(f"{r['name'].split('-alt', 1)[1]} {r['meas_tps']:,.0f} (pred {r['pred_tps']:,.0f})"
                             for r in alts) or "none measured"
        verdict = "yes" if best is pick else f"no ({best['meas_tps'] / pick['meas_tps'] - 1:+.1%})"
        lines.append(f"| {scenario} | {pick['name'].split('-pick-', 1)[1]} ({pick['pred_tps']:,.0f}) | "
                     f"{pick['meas_tps']:,.0f} / {alt_text} | {verdict} |")
    return lines


def _tree_rss(root: int) -> int:
    """Sum of VmRSS (bytes) over `root` and its descendants (torchrun's workers start sessions of their own)."""
    parent, rss = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            parent[int(pid)] = int(fields[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[int(pid)] = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    tree, todo = set(), [root]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in tree]
    return sum(rss.get(p, 0) for p in tree)


def host_rss_sampler(root: int, stop: threading.Event, peak: list[float]) -> None:
    """Largest sum of VmRSS over a process tree, sampled every 0.5 s."""
    while not stop.is_set():
        peak[0] = max(peak[0], _tree_rss(root))
        stop.wait(0.5)


def run_one(name: str, overrides: list[str], args: argparse.Namespace, data: Path, log) -> dict:
    out = Path(args.work) / name
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench/bench.yaml"), f"data.train_file={data}",
           f"train.max_steps={args.steps}", "log.every=2", "--output-dir", str(out), "--force", *overrides]
    shutil.rmtree(out, ignore_errors=True)  # a folder holding an earlier finished run would be refused (exit 2)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stop, peak = threading.Event(), [0.0]
    sampler = threading.Thread(target=host_rss_sampler, args=(proc.pid, stop, peak), daemon=True)
    sampler.start()
    try:
        text, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    stop.set()
    log.write(f"===== {name}: {' '.join(cmd)}\n{text[-6000:]}\n")
    row = {"name": name, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1),
           "host_rss_gib": round(peak[0] / 2**30, 2)}
    try:
        plan = json.loads((out / "plan.json").read_text())["chosen"]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError, KeyError):
        return row
    train = [r for r in records if not r.get("eval") and "tokens_per_sec_per_device" in r]
    steady = [r["tokens_per_sec_per_device"] for r in train if r["step"] - 2 >= args.warmup] or \
        [r["tokens_per_sec_per_device"] for r in train]
    knobs = ("backend", "strategy", "offload", "activation_checkpointing", "micro_batch_size")
    row.update(knobs={k: plan[k] for k in knobs}, pred_alloc=plan["memory_gib"]["allocated"],
               pred_reserved=plan["memory_gib"]["reserved"],
               pred_total=plan["memory_gib"]["total"], pred_tps=plan["tokens_per_sec_per_gpu"],
               pred_host=plan["host_memory_gib"], terms=plan["memory_gib"], time_terms=plan["time_terms_s"])
    if train:
        row.update(meas_alloc=max(r["peak_mem_gib"] for r in train),
                   meas_reserved=max(r["peak_reserved_gib"] for r in train),
                   meas_tps=statistics.median(steady), tps_min=min(steady), tps_max=max(steady), n=len(steady),
                   steps=train[-1]["step"])
    return row


def err(p: float | None, m: float | None) -> str:
    return f"{(p - m) / m:+.1%}" if p is not None and m else "-"


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | pred alloc GiB | meas alloc GiB | err | pred reserved | meas reserved | err | pred tok/s | "
             "meas tok/s (min-max, n) | err | host GiB pred/meas |", "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r.get('pred_alloc', '-')} | {r.get('meas_alloc', 0):.1f} | "
            f"{err(r.get('pred_alloc'), r.get('meas_alloc'))} | {r.get('pred_reserved', '-')} | "
            f"{r.get('meas_reserved', 0):.1f} | {err(r.get('pred_reserved'), r.get('meas_reserved'))} | "
            f"{r.get('pred_tps', 0):,.0f} | {r.get('meas_tps', 0):,.0f} ({r.get('tps_min', 0):,.0f}-"
            f"{r.get('tps_max', 0):,.0f}, {r.get('n', 0)}) | {err(r.get('pred_tps'), r.get('meas_tps'))} | "
            f"{r.get('pred_host', '-')}/{r['host_rss_gib']} |")
    return lines


def _seq(overrides: list[str]) -> int:
    """The train.seq_len a row's overrides set (0 where they leave bench.yaml's)."""
    return max([0] + [int(o.split("=", 1)[1]) for o in overrides if o.startswith("train.seq_len=")])


def _long_text(work: Path, seq: int) -> Path:
    """Random text with every line at least seq + 1 tokens long, so every row trains full sequences."""
    data = work / ("long.jsonl" if seq <= 4096 else f"long-{seq}.jsonl")
    data.parent.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        lines = 400 if seq <= 4096 else max(64, 400 * 4096 // seq)
        subprocess.run([sys.executable, str(ROOT / "bench/make_long_text.py"), str(data), "--n", str(lines),
                        "--chars", str(seq + 200), "--min-tokens", str(seq + 1)], check=True)
    return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--matrix", default="a", help="a, b, tiny, or a comma list of row names from any matrix")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/planner_accuracy"))
    ap.add_argument("--work", default="/tmp/planner_runs")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--budget", type=int, default=540, help="seconds for all runs; later rows are skipped")
    ap.add_argument("--pick", default=None, help="comma list of PICKS scenarios to run instead of a matrix")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.pick:
        scenarios = args.pick.split(",")
        longest = max([4096] + [_seq(PICKS[name]) for name in scenarios])
        data = _long_text(Path(args.work), longest)
        rows = [row for name in scenarios for row in pick_rows(name, PICKS[name], data)]
        print("\n".join(f"{n}: {' '.join(o)}" for n, _, o in rows), flush=True)
    else:
        every = {n: (n, s, o) for rows in MATRICES.values() for n, s, o in rows}
        rows = MATRICES.get(args.matrix) or [every[n] for n in args.matrix.split(",")]
        data = _long_text(Path(args.work), max([4096] + [_seq(o) for _, _, o in rows]))
    start, results = time.time(), []
    with open(out / "logs.txt", "a") as log, open(out / "results.jsonl", "a") as res:
        for name, scenario, overrides in rows:
            left = args.budget - (time.time() - start)
            if left < 40:
                print(f"skip {name}: budget", flush=True)
                continue
            args.timeout = min(args.timeout, int(left))
            row = {"scenario": scenario, **run_one(name, overrides, args, data, log), "overrides": overrides}
            results.append(row)
            res.write(json.dumps(row) + "\n")
            res.flush()
            print(json.dumps({k: v for k, v in row.items() if k not in ("terms", "time_terms")}), flush=True)
    lines = [*table(results), "", *pick_table(results)] if args.pick else table(results)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
