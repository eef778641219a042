"""Checkpoint cost: how long a save blocks training (sync vs async), and export time.

    python bench/checkpoint.py --size 1b --out /tmp/ck          # GPU machine, all GPUs
    python bench/checkpoint.py --size tiny --out /tmp/ck        # CPU plumbing check

Two runs of the same model and data, saving every `--every` steps, one with synchronous and one
with asynchronous (DCP async_save) checkpoints; each logs every step, so a step that saved shows
the time the loop was blocked (`checkpoint_s`, included in its step time), and the record after a
save's phases end shows how long they took (`checkpoint_staging_s`: copy to host memory;
`checkpoint_write_s`: until the checkpoint is complete and in place). "extra s during the save" adds
up, over the steps from the save until its write ended, how much longer they took than the median
step: the cost of a save to training (target for async: at most the staging time); the same sum over
as many steps just before the save shows its noise. Then
`shardtune export` of the last checkpoint to a bf16 Hugging Face directory, timed.
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
SIZES = {  # preset, seq_len, micro-batch, precision, steps, save every, processes
    "tiny": ("tiny-llama", 256, 2, "fp32", 12, 4, 2),
    "1b": ("llama-3.2-1b", 2048, 4, "bf16", 17, 8, "auto"),
}


MODES = {"sync": ("false", "auto"), "async": ("true", "auto"), "async-thread": ("true", "thread"),
         "async-process": ("true", "process")}  # checkpoint.async, checkpoint.async_writer


def train(size: str, out: Path, data: Path, mode: str, steps: int | None, every: int | None) -> dict:
    preset, seq, mbs, prec, steps_, every_, nproc = SIZES[size]
    steps, every = steps or steps_, every or every_
    cmd = [sys.executable, "-m", "shardtune", "train", str(ROOT / "bench" / "bench.yaml"), "--nproc", str(nproc),
           f"model.preset={preset}", f"data.train_file={data}", "data.eval_fraction=0", f"train.seq_len={seq}",
           f"train.micro_batch_size={mbs}", f"train.precision={prec}", f"train.max_steps={steps}",
           "log.every=1", "log.progress=false", "checkpoint.save_final=false", "parallel.strategy=zero3",
           f"checkpoint.every_steps={every}", f"checkpoint.async={MODES[mode][0]}",
           f"checkpoint.async_writer={MODES[mode][1]}",
           "checkpoint.keep_last=1", "checkpoint.at_end=false", f"train.output_dir={out}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out.parent / f"{out.name}.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 else []
    steps_ = [r for r in recs if "loss" in r and r["step"] > 2]
    saving = [r for r in steps_ if r.get("checkpoint_s")]
    plain = [r["step_time_s"] for r in steps_ if not r.get("checkpoint_s")]
    median = statistics.median(plain) if plain else None
    ckpt = sorted((out / "checkpoints").glob("step-*"))
    size_gb = sum(f.stat().st_size for f in ckpt[-1].rglob("*") if f.is_file()) / 1e9 if ckpt else 0
    return {"mode": mode, "rc": proc.returncode, "wall_s": time.time() - t0,
            "step_s": median, "save_step_s": [round(_wall(r), 3) for r in saving],
            "blocked_s": [round(r["checkpoint_s"], 3) for r in saving],
            "staging_s": [round(r["checkpoint_staging_s"], 3) for r in steps_ if "checkpoint_staging_s" in r],
            "write_s": [round(r["checkpoint_write_s"], 3) for r in steps_ if "checkpoint_write_s" in r],
            "extra_s": [round(x, 3) for x in _extra_during_saves(steps_, median)] if median else [],
            "control_s": [round(x, 3) for x in _extra_before_saves(steps_, median)] if median else [],
            # the steps right after an async save overlap with its write
            "after_save_step_s": [round(r["step_time_s"], 3) for r in steps_
                                  if any(r["step"] == s["step"] + 1 for s in saving)],
            "checkpoint_gb": round(size_gb, 2), "last": str(ckpt[-1]) if ckpt else None}


def _wall(r: dict) -> float:
    """The step's wall time, save included: records leave checkpoint_s out of step_time_s (log.every=1 here,
    so one step per record)."""
    return r["step_time_s"] + r.get("checkpoint_s", 0.0)


def _extra_during_saves(records: list[dict], median: float) -> list[float]:
    """Per save: the summed excess over the median step time, from the step that saved to the record
    that reports its write done (log.every=1: one record per step)."""
    out, extra = [], None
    for r in records:
        if r.get("checkpoint_s") and extra is None:
            extra = 0.0
        if extra is not None:
            extra += _wall(r) - median
            if "checkpoint_write_s" in r:
                out.append(extra)
                extra = None
    return out


def _extra_before_saves(records: list[dict], median: float) -> list[float]:
    """The same sum over as many steps right before each save, where no save runs: how much such a sum
    varies without one (the noise of "extra s")."""
    out, start = [], None
    for i, r in enumerate(records):
        if r.get("checkpoint_s") and start is None:
            start = i
        if start is not None and "checkpoint_write_s" in r:
            window = records[max(0, 2 * start - i - 1):start]
            if len(window) == i - start + 1 and not any(w.get("checkpoint_s") or "checkpoint_write_s" in w
                                                       for w in window):
                out.append(sum(_wall(w) - median for w in window))
            start = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--out", default="/tmp/shardtune_ckpt")
    ap.add_argument("--modes", default="sync,async", help=f"which of {','.join(MODES)} to run (export uses the "
                    "first)")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: per size)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint.every_steps (default: per size)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "long.jsonl"
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_long_text.py"), str(data), "--n", "256",
                    "--chars", str(SIZES[args.size][1] + 300), "--min-tokens", str(SIZES[args.size][1])],
                   check=True, capture_output=True)
    results = []
    for mode in args.modes.split(","):
        results.append(train(args.size, out / mode, data, mode, args.steps, args.every))
        print(json.dumps(results[-1]), flush=True)
    export = {"mode": "export", "rc": None}
    if results[0]["last"]:
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "shardtune", "export", results[0]["last"], str(out / "hf"),
                               "--dtype", "bf16"], capture_output=True, text=True, check=False)
        export.update(rc=proc.returncode, wall_s=round(time.time() - t0, 1), err=proc.stderr[-500:])
    (out / "checkpoint_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*results, export]))
    print(f"\n{args.size}: {SIZES[args.size]}")
    print("| mode | rc | checkpoint GB | median step s | loop blocked s | staging s | write s | next step s "
          "| extra s during the save | same sum, as many steps before it |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['rc']} | {r['checkpoint_gb']} | {r['step_s']} | {r['blocked_s']} | "
              f"{r['staging_s']} | {r['write_s']} | {r['after_save_step_s']} | {r['extra_s']} | {r['control_s']} |")
    print(f"export (bf16 HF dir): rc {export['rc']}, {export.get('wall_s')} s")


if __name__ == "__main__":
    main()
