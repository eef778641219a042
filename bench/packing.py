"""Packing vs padded batches: effective (non-padding) tokens/s on a long-tailed chat data set.

    python bench/packing.py --size tiny --out /tmp/pack           # CPU, 2 processes
    python bench/packing.py --size 1b --out $OUT                  # GPU machine, all GPUs

Generates conversations with log-normal lengths (median ~300 tokens, max 4096: bench/make_chat_data.py),
then trains the same model on them padded (one conversation per row) and packed (best-fit-decreasing
rows, document-masked attention), and reports the median tokens/s over logged intervals after warm-up.
Every row holds seq_len tokens either way, so the ratio is the useful work per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # preset, seq_len, micro-batch, precision, steps, log every, warm-up records skipped, processes
    "tiny": ("tiny-llama", 2048, 1, "fp32", 24, 4, 1, 2),
    "1b": ("llama-3.2-1b", 4096, 2, "bf16", 30, 5, 2, "auto"),
}
VARIANTS = {
    "padded": ["data.packing=false", "model.attn_implementation=sdpa"],
    "packed_sdpa": ["data.packing=true", "model.attn_implementation=sdpa"],
    "packed_flex": ["data.packing=true", "model.attn_implementation=flex_attention"],
}


def run(variant: str, size: str, data: Path, out: Path, extra: list[str]) -> dict:
    preset, seq, mbs, prec, steps, every, skip, nproc = SIZES[size]
    run_dir = out / variant
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench" / "bench.yaml"), "--nproc", str(nproc),
           f"model.preset={preset}", f"data.train_file={data}", "data.eval_fraction=0", f"train.seq_len={seq}",
           f"train.micro_batch_size={mbs}", f"train.precision={prec}", f"train.max_steps={steps}",
           f"log.every={every}", "log.progress=false", "checkpoint.save_final=false", "parallel.strategy=zero3",
           f"train.output_dir={run_dir}", *VARIANTS[variant], *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out / f"{variant}.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    result = {"variant": variant, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        recs = [json.loads(x) for x in metrics.read_text().splitlines()]
        steady = [r for r in recs if not r.get("eval")][skip:]
        if steady:
            result.update(
                tokens_per_sec=statistics.median(r["tokens_per_sec"] for r in steady),
                mfu=statistics.median(r["mfu"] for r in steady) if steady[0]["mfu"] is not None else None,
                peak_mem_gib=max(r["peak_mem_gib"] for r in steady),
                step_s=statistics.median(r["step_time_s"] for r in steady))
    data_line = [line for line in proc.stderr.splitlines() if line.startswith("data:")]
    result["data"] = data_line[0] if data_line else proc.stderr.strip().splitlines()[-1:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--out", default="/tmp/shardtune_packing")
    ap.add_argument("--variants", default="padded,packed_sdpa,packed_flex")
    ap.add_argument("--n", type=int, default=3000, help="conversations to generate")
    ap.add_argument("extra", nargs="*", help="more shardtune overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "chat.jsonl"
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_chat_data.py"), str(data), "--n", str(args.n),
                    "--median", "300", "--max", "4096"], check=True)
    results = [run(v, args.size, data, out, args.extra) for v in args.variants.split(",")]
    (out / "packing_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    base = next((r.get("tokens_per_sec") for r in results if r["variant"] == "padded"), None)
    print(f"\n{args.size}: {SIZES[args.size][:4]}, zero3")
    print("| variant | rc | effective tokens/s | vs padded | MFU | peak GiB | step s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        tps = r.get("tokens_per_sec")
        ratio = f"{tps / base:.2f}" if tps and base else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        print(f"| {r['variant']} | {r['rc']} | {tps:,.0f} | {ratio} | {mfu} | {r.get('peak_mem_gib', 0):.1f} | "
              f"{r.get('step_s', 0):.3f} |" if tps else f"| {r['variant']} | {r['rc']} | - | - | - | - | - |")
    for r in results:
        print(f"{r['variant']}: {r['data']}")


if __name__ == "__main__":
    main()
