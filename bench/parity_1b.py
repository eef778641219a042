"""Issue 17's loss parity on the GPU: every speed lever's run against the eager path's, step for step.

Each run trains the same model (the preset's random init, model.seed) on the same data in the same order (train.seed)
for --steps steps, logging every step; the reference is the plain eager path (no compile, no Liger, FSDP2 on one
process, no checkpointing). The eager run is repeated (`eager2`) to show the noise floor of bf16 on the GPU (its
atomics make two identical runs drift apart). A lever passes when its run ended cleanly with every step, said it
applied (where that depends on the machine: Liger installed, float8 matmuls), its first step is within FIRST of the
reference (the forward is the same computation), every step within STEP, and the mean of the last ten within TAIL
(relative differences; float8 rows get the FLOAT8 bounds: another numeric recipe). Each set also runs a control that
trains nothing (`frozen`, lr 1e-12): it must fall outside the bounds, else the set's learning rate and steps cannot
tell a lever that breaks training from one that keeps it (the table says so). The LoRA / QLoRA sets train at lr 2e-4
so that their adapters move the loss in 50 steps.

    # on the GPU machine (after the wheel install; PYTHONPATH=/tmp/site:src); a 1B run is ~30-60 s (compile), so
    # the full set takes two calls:
    python3 bench/parity_1b.py --set full --variants eager2,compile,direct,liger_loss,liger_chunk,liger_kernels \
        --out $OUT/a --budget 540
    python3 bench/parity_1b.py --set full --variants selective,full_ac,act_offload,defaults,float8,float8_defaults \
        --out $OUT/b --budget 540
    python3 bench/parity_1b.py --set lora --out $OUT/lora --budget 540   # then --set qlora, --set deepspeed
    # CPU dry run (fp32, where the levers that run on a CPU must match to rounding):
    python3 bench/parity_1b.py --set full --preset tiny-llama --precision fp32 --seq 128 --mbs 2 --steps 6 \\
        --variants eager2,direct,selective,full_ac,act_offload --out /tmp/parity

Writes OUT/parity_SET.md (the table) and OUT/parity_SET.jsonl (every run's losses, command, exit code, time); the
runs' logs stay in OUT/runs/NAME.log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The eager path each set compares against; a variant's overrides go after these.
REFERENCE = {
    "full": ["parallel.strategy=zero2", "parallel.compile=false", "model.liger=false", "model.liger_chunk=0",
             "parallel.one_gpu=fsdp2", "parallel.activation_checkpointing=none"],
    "lora": ["peft.method=lora", "peft.r=16", "train.lr=2e-4", "parallel.strategy=zero2", "parallel.compile=false",
             "model.liger=false", "model.liger_chunk=0", "parallel.one_gpu=fsdp2",
             "parallel.activation_checkpointing=full"],
    "qlora": ["peft.method=qlora", "peft.r=16", "train.lr=2e-4", "parallel.strategy=zero2", "parallel.compile=false",
              "model.liger=false", "model.liger_chunk=0", "parallel.one_gpu=fsdp2",
              "parallel.activation_checkpointing=full"],
    # DeepSpeed's own reference (its bf16 masters start from bf16-rounded weights, FSDP2's from fp32)
    "deepspeed": ["parallel.backend=deepspeed", "parallel.strategy=zero2", "parallel.compile=false",
                  "model.liger=false", "parallel.activation_checkpointing=none"],
}
CONTROL = "frozen"  # trains nothing: must fall outside the bounds
F8 = "train.float8=tensorwise"
VARIANTS = {
    "full": {
        "eager2": [],
        "compile": ["parallel.compile=true"],
        "direct": ["parallel.one_gpu=direct"],
        "liger_loss": ["model.liger=loss"],
        "liger_chunk": ["model.liger=loss", "model.liger_chunk=1024"],
        "liger_accum": ["parallel.compile=true", "model.liger=loss", "model.liger_chunk=auto",
                        "parallel.one_gpu=auto", "model.liger_accum=weight"],
        "liger_kernels": ["model.liger=true"],
        "selective": ["parallel.activation_checkpointing=selective"],
        "full_ac": ["parallel.activation_checkpointing=full"],
        "act_offload": ["parallel.activation_checkpointing=full", "parallel.activation_offload=true"],
        "ckpt_in_compile": ["parallel.activation_checkpointing=full", "parallel.compile=true",
                            "parallel.checkpoint_in_compile=true"],
        "ckpt_around": ["parallel.activation_checkpointing=full", "parallel.compile=true",
                        "parallel.checkpoint_in_compile=false"],
        "defaults": ["parallel.compile=true", "model.liger=auto", "model.liger_chunk=auto", "parallel.one_gpu=auto"],
        "float8": ["parallel.compile=true", F8],
        "float8_defaults": ["parallel.compile=true", "model.liger=auto", "model.liger_chunk=auto",
                            "parallel.one_gpu=auto", F8],
    },
    "lora": {
        "eager2": [],
        "direct": ["parallel.one_gpu=direct"],
        "compile": ["parallel.compile=true"],
        "ckpt_in_compile": ["parallel.compile=true", "parallel.checkpoint_in_compile=true"],
        "ckpt_around": ["parallel.compile=true", "parallel.checkpoint_in_compile=false"],
        "liger_loss": ["model.liger=loss"],
        "defaults": ["parallel.compile=true", "model.liger=auto", "model.liger_chunk=auto", "parallel.one_gpu=auto"],
        "float8": ["parallel.compile=true", "model.liger=auto", "parallel.one_gpu=auto", F8],
        "float8_base": ["parallel.compile=true", "model.liger=auto", "parallel.one_gpu=auto", F8,
                        "peft.base_dtype=float8"],
    },
    "qlora": {
        "eager2": [],
        "direct": ["parallel.one_gpu=direct"],
        "compile": ["parallel.compile=true"],
        "defaults": ["parallel.compile=true", "model.liger=auto", "model.liger_chunk=auto", "parallel.one_gpu=auto"],
    },
    "deepspeed": {  # model.liger: auto takes Liger's kernels here (no compile; DeepSpeed keeps the plain loss)
        "eager2": [],
        "liger_auto": ["model.liger=auto"],
        "compile": ["parallel.compile=true"],
    },
}
for _variants in VARIANTS.values():
    _variants[CONTROL] = ["train.lr=1e-12"]
# What a run's log says when a lever that depends on the machine applied (Liger installed, float8 matmuls).
EXPECT = {"liger_loss": "fused linear + cross-entropy", "liger_chunk": "fused linear + cross-entropy",
          "liger_accum": "summed in its weight's dtype",
          "liger_kernels": "RMSNorm, RoPE, SwiGLU kernels", "liger_auto": "RMSNorm, RoPE, SwiGLU kernels",
          **{name: "float8 (tensorwise)" for name in ("float8", "float8_defaults", "float8_base")}}
# Relative bounds: (first step, every step, mean of the last ten steps).
BOUNDS = {"bf16": (0.005, 0.02, 0.01), "float8": (0.01, 0.04, 0.02), "fp32": (1e-5, 1e-4, 1e-4)}


def bounds(name: str, overrides: list[str], precision: str) -> tuple[float, float, float]:
    return BOUNDS["float8"] if F8 in overrides else BOUNDS[precision]


def losses_of(run_dir: Path) -> list[float]:
    """The per-step training losses a run logged (log.every=1), in step order."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in sorted((r for r in rows if "loss" in r and not r.get("eval")), key=lambda r: r["step"])]


def compare(ref: list[float], got: list[float], bound: tuple[float, float, float]) -> dict:
    """Relative differences of `got` from `ref` over their common steps, and whether they are within `bound`
    (every step of the reference logged by both)."""
    n = min(len(ref), len(got))
    if n == 0:
        return {"steps": 0, "ok": False}
    rel = [abs(g - r) / abs(r) for r, g in zip(ref[:n], got[:n], strict=True)]
    tail = max(1, min(10, n))
    tail_ref, tail_got = sum(ref[n - tail:n]) / tail, sum(got[n - tail:n]) / tail
    out = {"steps": n, "first": rel[0], "max": max(rel), "max_at": rel.index(max(rel)) + 1,
           "tail": abs(tail_got - tail_ref) / abs(tail_ref)}
    out["ok"] = n == len(ref) and out["first"] <= bound[0] and out["max"] <= bound[1] and out["tail"] <= bound[2]
    return out


def make_data(path: Path, seq: int) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_long_text.py"), str(path), "--n", "512",
                        "--chars", str(int(seq * 1.15)), "--seed", "0", "--min-tokens", str(seq)], check=True)


def run_overrides(args: argparse.Namespace, data: Path | str, out_dir: Path, overrides: list[str]) -> list[str]:
    """The overrides of bench/bench.yaml one run takes (tests/unit/test_bench_variants.py checks each variant's)."""
    return [f"model.preset={args.preset}", f"data.train_file={data}", "data.eval_fraction=0",
            f"train.precision={args.precision}", f"train.seq_len={args.seq}", f"train.micro_batch_size={args.mbs}",
            "train.grad_accum=1", f"train.max_steps={args.steps}", f"train.output_dir={out_dir}", "log.every=1",
            "log.progress=false", "log.jsonl=true", "checkpoint.save_final=false", *overrides]


def run(name: str, overrides: list[str], args: argparse.Namespace, data: Path, timeout: float) -> dict:
    out_dir = args.out / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)  # never read an earlier call's metrics for a run that failed now
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench" / "bench.yaml"), "--nproc", "1",
           "--overwrite", *run_overrides(args, data, out_dir, overrides)]
    t0 = time.time()
    log = args.out / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = log.read_text()
    tail = text.strip().splitlines()[-3:] if rc else []
    applied = EXPECT.get(name) is None or EXPECT[name] in text
    return {"name": name, "overrides": overrides, "rc": rc, "seconds": round(time.time() - t0, 1),
            "losses": losses_of(out_dir), "tail": tail, "applied": applied}


def verdict(r: dict, ref_ok: bool) -> tuple[bool, str]:
    """Whether row `r` passes, and the table's word for it."""
    c = r.get("cmp") or {}
    within = bool(c.get("ok"))
    if r["name"] == CONTROL:
        return not within, ("differs (as it must)" if not within and c.get("steps") else
                            "CONTROL WITHIN BOUNDS: this set cannot tell a broken lever" if within else "no losses")
    if not ref_ok:
        return False, "no reference"
    if r["rc"] != 0:
        return False, "failed" + (f": {r['tail'][-1][:120]}" if r.get("tail") else "")
    if not r.get("applied", True):
        return False, f"NOT APPLIED (no '{EXPECT[r['name']]}' in its log)"
    return within, "yes" if within else "NO"


def table(set_name: str, rows: list[dict], args: argparse.Namespace, ref_ok: bool) -> str:
    head = (f"{set_name}: {args.preset}, {args.precision}, seq {args.seq}, micro-batch {args.mbs}, {args.steps} steps "
            f"against `{'`, `'.join(REFERENCE[set_name])}`; bounds (first, every step, last-ten mean): "
            + ", ".join(f"{k} {b[0]:.0e} / {b[1]:.0e} / {b[2]:.0e}" for k, b in BOUNDS.items() if k != "fp32"
                        or args.precision == "fp32"))
    lines = [head, "", "| run | overrides | rc | s | first | max (step) | last-ten mean | final loss | within |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("cmp") or {}
        final = f"{r['losses'][-1]:.4f}" if r["losses"] else "-"
        if r["name"] == "eager":
            word = "reference" if ref_ok else f"reference FAILED ({len(r['losses'])} of {args.steps} steps)"
        else:
            word = verdict(r, ref_ok)[1]
        diffs = (f"{c['first']:.2e} | {c['max']:.2e} ({c['max_at']}) | {c['tail']:.2e}" if c.get("steps")
                 else "- | - | -")
        lines.append(f"| {r['name']} | {' '.join(r['overrides'])} | {r['rc']} | {r['seconds']} | {diffs} | {final} | "
                     f"{word.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", dest="set_name", choices=sorted(REFERENCE), default="full")
    p.add_argument("--variants", default="", help="comma-separated names (default: every one of the set)")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--budget", type=float, default=540, help="seconds; no run starts that could end past it")
    p.add_argument("--timeout", type=float, default=150, help="seconds per run")
    p.add_argument("--data", type=Path, default=None, help="JSONL of long texts (default: generated into OUT)")
    p.add_argument("--out", type=Path, default=Path("/tmp/parity"))
    args = p.parse_args(argv)
    start = time.time()
    data = args.data or args.out / "long.jsonl"
    make_data(data, args.seq)
    wanted = [v for v in args.variants.split(",") if v] or list(VARIANTS[args.set_name])
    wanted += [CONTROL] if CONTROL not in wanted else []  # every call shows whether its bounds can tell
    unknown = [v for v in wanted if v not in VARIANTS[args.set_name]]
    if unknown:
        print(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS[args.set_name])}")
        return 2
    ref = run("eager", REFERENCE[args.set_name], args, data, args.timeout)
    ref_ok = ref["rc"] == 0 and len(ref["losses"]) == args.steps
    print(f"eager: rc {ref['rc']} in {ref['seconds']} s, {len(ref['losses'])} losses", flush=True)
    rows = [ref]
    for name in wanted:
        left = args.budget - (time.time() - start)
        if left < 30:
            rows.append({"name": name, "overrides": VARIANTS[args.set_name][name], "rc": "budget", "seconds": 0,
                         "losses": [], "tail": ["not run: the budget was spent"]})
            continue
        overrides = VARIANTS[args.set_name][name]
        r = run(name, REFERENCE[args.set_name] + overrides, args, data, min(args.timeout, left))
        r["overrides"] = overrides
        r["cmp"] = compare(ref["losses"], r["losses"], bounds(name, overrides, args.precision))
        print(f"{name}: rc {r['rc']} in {r['seconds']} s, {r['cmp']}", flush=True)
        rows.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(args.set_name, rows, args, ref_ok)
    (args.out / f"parity_{args.set_name}.md").write_text(text)
    with (args.out / f"parity_{args.set_name}.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
