"""Turn benchmark runs into results.jsonl and a markdown table (pure Python, no torch).

Two ways to name the runs:

    python3 bench/summarize.py --manifest /tmp/shardtune_bench/1b/runs.tsv --results OUT/results.jsonl
    python3 bench/summarize.py zero2=/tmp/run/zero2/metrics.jsonl hf_ds2=/tmp/hf_ds2.log

A shardtune run is read from its metrics.jsonl (eval records, ``"eval": true``, are skipped); its
steady state is the median over logged records whose interval starts at or after ``--warmup`` (a record
covers the steps after the previous record's, ``step - log.every``, up to its ``step``: a record that
ends past the warm-up but began inside it still times warm-up steps; records that include a checkpoint
save are left out too). A baseline run is read from the last
``RESULT {json}`` line of its log (hf_baseline.py already reports a median step time after warm-up).
Ratios are tokens/s/GPU of the row divided by the reference run's (``--ref``, default hf_ds2),
measured in the same call. A ratio is refused (left empty, with a note) when the row's micro-batch,
seq_len, world size or precision differs from the reference's. NAME=PATH pairs must come from one call
(one folder, as core.sh writes them: DIR/NAME.log, DIR/NAME/metrics.jsonl); pairs from different folders
are refused (exit 2) unless ``--cross-call`` marks the table as mixing calls.

Manifest: one run per line, tab-separated: name, kind (shardtune | baseline | skipped), rc,
wall seconds, log path, metrics path (empty for baselines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

REF_DEFAULT = "hf_ds2"
SECOND_REF = "fsdp2c"  # plain FSDP2 + compile, when it was run: extra ratio column
_EXC_RE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b(:|$)|^error: |out of memory")
_ERR_RE = re.compile(r"(error|exception|killed|signal|sigkill|sigterm)", re.IGNORECASE)


# ---- reading ---------------------------------------------------------------------------------
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by a kill
        if isinstance(row, dict):
            out.append(row)
    return out


def read_result_line(log: str | Path) -> dict[str, Any] | None:
    """The last ``RESULT {json}`` line of a baseline log, or None."""
    p = Path(log)
    if not p.is_file():
        return None
    found = None
    for line in p.read_text(errors="replace").splitlines():
        idx = line.find("RESULT {")
        if idx >= 0:
            with contextlib.suppress(json.JSONDecodeError):
                found = json.loads(line[idx + len("RESULT "):])
    return found


def last_error_line(log: str | Path | None, limit: int = 200) -> str | None:
    """The most telling failure line of a log: the last exception line of a worker (not torchrun's
    ChildFailedError wrapper), else shardtune's one-line ``error: ...``, else the last line."""
    if not log or not Path(log).is_file():
        return None
    lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
    for pattern in (_EXC_RE, _ERR_RE):
        for line in reversed(lines):
            if pattern.search(line) and "ChildFailedError" not in line and "elastic/errors" not in line:
                return line[:limit]
    return lines[-1][:limit] if lines else None


def _read_run_config(metrics_path: Path) -> dict[str, Any]:
    """micro_batch_size / seq_len / strategy from the run's config.yaml next to metrics.jsonl, if readable."""
    cfg_path = metrics_path.parent / "config.yaml"
    if not cfg_path.is_file():
        return {}
    try:
        import yaml

        cfg = yaml.safe_load(cfg_path.read_text()) or {}
    except Exception:
        return {}
    train, par = cfg.get("train", {}) or {}, cfg.get("parallel", {}) or {}
    return {"mbs": train.get("micro_batch_size"), "seq": train.get("seq_len"), "strategy": par.get("strategy"),
            "log_every": (cfg.get("log") or {}).get("every"),
            "compile": par.get("compile"), "precision": train.get("precision"),
            "preset": (cfg.get("model") or {}).get("preset")}


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(float(v))]
    return statistics.median(vals) if vals else None


# ---- one run ---------------------------------------------------------------------------------
def summarize_shardtune(name: str, metrics_path: str | Path, warmup: int) -> dict[str, Any]:
    metrics_path = Path(metrics_path or "/nonexistent/metrics.jsonl")
    rows = read_jsonl(metrics_path)
    train = [r for r in rows if not r.get("eval") and "tokens_per_sec_per_device" in r]
    out: dict[str, Any] = {"name": name, "kind": "shardtune", "records": len(train)}
    out.update({k: v for k, v in _read_run_config(metrics_path).items() if v is not None})
    if not train:
        out["status"] = "no-data"
        return out
    every = out.pop("log_every", None)
    # Each record times the interval since the previous record (log.every steps; the last may be shorter).
    starts = [prev.get("step", 0) for prev in [{"step": 0}, *train[:-1]]]
    if isinstance(every, int) and every > 0:
        starts = [max(start, r.get("step", 0) - every) for start, r in zip(starts, train, strict=True)]
    steady = [r for start, r in zip(starts, train, strict=True) if start >= warmup]
    # A record whose interval held a checkpoint save times the save, not training.
    saved = [r for r in steady if r.get("checkpoint_s")]
    if saved and len(saved) < len(steady):
        steady = [r for r in steady if not r.get("checkpoint_s")]
        out["skipped_checkpoint_steps"] = [r.get("step") for r in saved]
    if not steady:
        steady = train[-1:]
        out["warmup_fallback"] = True  # run too short: only the last record, warm-up included
    out.update(
        status="ok",
        steady_records=len(steady),
        steady_steps=[r.get("step") for r in steady],
        last_step=train[-1].get("step"),
        tokens_per_s_per_gpu=_median([r.get("tokens_per_sec_per_device") for r in steady]),
        tokens_per_s=_median([r.get("tokens_per_sec") for r in steady]),
        tokens_per_s_per_gpu_min=min(r.get("tokens_per_sec_per_device") or 0.0 for r in steady),
        tokens_per_s_per_gpu_max=max(r.get("tokens_per_sec_per_device") or 0.0 for r in steady),
        mfu=_median([r.get("mfu") for r in steady]),
        step_time_s=_median([r.get("step_time_s") for r in steady]),
        peak_alloc_gib=max((r.get("peak_mem_gib") or 0.0) for r in train),
        peak_reserved_gib=max((r.get("peak_reserved_gib") or 0.0) for r in train),
        loss_first=train[0].get("loss"),
        loss_last=train[-1].get("loss"),
        tokens_per_s_per_gpu_all=[round(r["tokens_per_sec_per_device"]) for r in train],
    )
    last = train[-1]
    if last.get("tokens_per_sec") and last.get("tokens_per_sec_per_device"):
        out["world"] = round(last["tokens_per_sec"] / last["tokens_per_sec_per_device"])
    # Sanity: tokens per step and GPU / (micro_batch * seq_len) is 1.0 when no row is padded.
    mbs, seq, tps, st = out.get("mbs"), out.get("seq"), out["tokens_per_s_per_gpu"], out["step_time_s"]
    if mbs and seq and tps and st:
        out["fill"] = round(tps * st / (mbs * seq), 4)
    return out


def summarize_baseline(name: str, log: str | Path) -> dict[str, Any]:
    res = read_result_line(log)
    out: dict[str, Any] = {"name": name, "kind": "baseline"}
    if res is None:
        out["status"] = "no-data"
        return out
    out.update(
        status="ok",
        mode=res.get("mode"), size=res.get("size"), world=res.get("world"), seq=res.get("seq"), mbs=res.get("mbs"),
        precision=res.get("precision"),
        tokens_per_s_per_gpu=res.get("tokens_per_s_per_gpu"),
        # Spread and the number of timed steps, where the baseline reports them (bench/hf_trainer_baseline.py).
        tokens_per_s_per_gpu_min=res.get("tokens_per_s_per_gpu_min"),
        tokens_per_s_per_gpu_max=res.get("tokens_per_s_per_gpu_max"),
        steady_records=res.get("steps_timed"),
        mfu=res.get("mfu_989"),
        step_time_s=res.get("step_s_median"),
        peak_alloc_gib=res.get("peak_alloc_gib"),
        peak_reserved_gib=res.get("peak_reserved_gib"),
        raw=res,
    )
    return out


def summarize_entry(entry: dict[str, Any], warmup: int) -> dict[str, Any]:
    """entry: name, kind, rc, wall_s, log, metrics (from the manifest or the command line)."""
    kind = entry.get("kind", "shardtune")
    if kind == "skipped":
        res: dict[str, Any] = {"name": entry["name"], "kind": "skipped", "status": "skipped"}
    elif kind == "baseline":
        res = summarize_baseline(entry["name"], entry.get("log") or "")
    else:
        res = summarize_shardtune(entry["name"], entry.get("metrics") or "", warmup)
    rc = entry.get("rc")
    res["rc"] = rc
    if entry.get("wall_s") is not None:
        res["wall_s"] = entry["wall_s"]
    if rc not in (None, 0):
        # Numbers from a killed run are kept (a timeout after the last log still measured the steady
        # state), but the status says what happened.
        res["has_data"] = res.get("status") == "ok"
        if res["kind"] != "skipped":
            res["error"] = last_error_line(entry.get("log"))
        if res["has_data"] and rc not in (124, 137) and _finished(entry, res):
            # It finished (RESULT printed / summary.json written) and then died on the way out,
            # e.g. a gloo abort at interpreter shutdown: the numbers stand.
            res["exit_note"] = f"rc={rc} after finishing"
        else:
            res["status"] = "timeout" if rc in (124, 137) else "failed"
    return res


def _finished(entry: dict[str, Any], res: dict[str, Any]) -> bool:
    if res["kind"] == "baseline":
        return True  # the RESULT line is printed after the last step
    metrics = entry.get("metrics")
    return bool(metrics) and (Path(metrics).parent / "summary.json").is_file()


# What must be equal for a throughput ratio to compare like with like: (field, what the note calls it).
SAME_SHAPE = (("mbs", "micro-batch"), ("seq", "seq_len"), ("world", "world size"), ("precision", "precision"))


def shape_mismatch(row: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Why `row` cannot be divided by `base`: the fields both know and that differ, or None."""
    diffs = [f"{label} {row[k]} vs {base[k]}" for k, label in SAME_SHAPE
             if row.get(k) is not None and base.get(k) is not None and row[k] != base[k]]
    return ", ".join(diffs) or None


def add_ratios(results: list[dict[str, Any]], ref: str, second: str = SECOND_REF) -> None:
    def find(name: str) -> dict[str, Any] | None:
        for r in results:
            if r["name"] == name and r.get("tokens_per_s_per_gpu"):
                return r
        return None

    for key, ref_name in ((f"ratio_vs_{ref}", ref), (f"ratio_vs_{second}", second)):
        base = find(ref_name)
        for r in results:
            v = r.get("tokens_per_s_per_gpu")
            why = shape_mismatch(r, base) if base else None
            if why:
                r.setdefault("ratio_refused", {})[ref_name] = why
            r[key] = round(float(v) / float(base["tokens_per_s_per_gpu"]), 4) if base and v and not why else None


# ---- output ----------------------------------------------------------------------------------
def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "–"
    if kind == "int":
        return f"{float(v):,.0f}"
    if kind == "pct":
        return f"{100 * float(v):.1f}%"
    if kind == "ratio":
        return f"{float(v):.2f}"
    if kind == "gib":
        return f"{float(v):.1f}"
    if kind == "s":
        return f"{float(v):.3f}"
    return str(v)


def _suffix(r: dict[str, Any]) -> str:
    status = r.get("status")
    if status == "ok":
        return ""
    if status == "failed":
        return f" (rc={r.get('rc')})"
    if status == "timeout":
        return " (timeout)" if r.get("has_data") else " (timeout, no data)"
    return f" ({status})"


def _spread(r: dict[str, Any]) -> str:
    lo, hi, n = r.get("tokens_per_s_per_gpu_min"), r.get("tokens_per_s_per_gpu_max"), r.get("steady_records")
    if lo is None or hi is None:
        return "–"
    return f"{float(lo):,.0f}-{float(hi):,.0f}" + (f" (n={n})" if n else "")


def render_table(results: list[dict[str, Any]], ref: str, second_ref: str = SECOND_REF, spread: bool = False) -> str:
    second = any(r["name"] == second_ref and r.get("tokens_per_s_per_gpu") for r in results) and ref != second_ref
    head = ["variant", "tokens/s/GPU"] + (["min-max"] if spread else []) + [f"ratio vs {ref}"] + (
        [f"vs {second_ref}"] if second else []) + ["MFU", "peak alloc GiB", "peak reserved GiB", "step time s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        name = r["name"] + _suffix(r)
        cells = [name, _fmt(r.get("tokens_per_s_per_gpu"), "int")] + ([_spread(r)] if spread else []) + [
            _fmt(r.get(f"ratio_vs_{ref}"), "ratio")]
        if second:
            cells.append(_fmt(r.get(f"ratio_vs_{second_ref}"), "ratio"))
        cells += [_fmt(r.get("mfu"), "pct"), _fmt(r.get("peak_alloc_gib"), "gib"),
                  _fmt(r.get("peak_reserved_gib"), "gib"), _fmt(r.get("step_time_s"), "s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_notes(results: list[dict[str, Any]], warmup: int) -> str:
    notes = []
    for r in results:
        if r.get("status") != "ok":
            what = f"{r.get('status')}" + (f" rc={r['rc']}" if r.get("rc") not in (None, 0) else "")
            if r.get("status") == "timeout" and r.get("has_data"):
                what += " (numbers are from the records logged before the kill)"
            notes.append(f"- {r['name']}: {what}" + (f" — {r['error']}" if r.get("error") else ""))
        if r.get("exit_note"):
            notes.append(f"- {r['name']}: {r['exit_note']}" + (f" — {r['error']}" if r.get("error") else ""))
        if r.get("warmup_fallback"):
            notes.append(f"- {r['name']}: no record after step {warmup}; used the last record (warm-up included)")
        for ref_name, why in (r.get("ratio_refused") or {}).items():
            notes.append(f"- {r['name']}: no ratio vs {ref_name}: {why} (compare runs of one shape)")
        fill = r.get("fill")
        if fill is not None and fill < 0.99:
            notes.append(f"- {r['name']}: only {fill:.0%} of each micro-batch is real tokens (padding) — "
                         "throughput is not comparable")
    return "\n".join(notes)


def parse_manifest(path: str | Path) -> list[dict[str, Any]]:
    entries = []
    for line in Path(path).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t") + [""] * 6
        name, kind, rc, wall, log, metrics = (p.strip() for p in parts[:6])
        entries.append({"name": name, "kind": kind or "shardtune",
                        "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                        "wall_s": float(wall) if re.fullmatch(r"\d+(\.\d+)?", wall) else None,
                        "log": log or None, "metrics": metrics or None})
    return entries


def _refuse(message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (no traceback)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def parse_pairs(pairs: list[str]) -> list[dict[str, Any]]:
    entries = []
    for item in pairs:
        name, sep, path = item.partition("=")
        if not sep:
            _refuse(f"summarize: {item!r}: expected NAME=PATH (metrics.jsonl or a baseline log)")
        if path.endswith(".jsonl"):
            entries.append({"name": name, "kind": "shardtune", "metrics": path, "log": None, "rc": None})
        else:
            entries.append({"name": name, "kind": "baseline", "log": path, "rc": None})
    return entries


def call_folder(entry: dict[str, Any]) -> Path:
    """The folder one call wrote its runs into (core.sh: DIR/NAME/metrics.jsonl, DIR/NAME.log)."""
    if entry.get("metrics"):
        return Path(entry["metrics"]).resolve().parent.parent
    return Path(entry["log"]).resolve().parent


def check_one_call(entries: list[dict[str, Any]]) -> None:
    """Refuse NAME=PATH pairs from different folders: ratios across calls (machines) mean nothing."""
    folders = {call_folder(e) for e in entries}
    if len(folders) > 1:
        names = ", ".join(f"{e['name']} ({call_folder(e)})" for e in entries)
        _refuse(f"summarize: the runs come from {len(folders)} folders, i.e. different calls: {names}; "
                "summarize one call's runs, or pass --cross-call to mark the table as mixing calls")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize shardtune benchmark runs into a markdown table.")
    ap.add_argument("runs", nargs="*", help="NAME=PATH: a metrics.jsonl (shardtune) or a log with RESULT (baseline)")
    ap.add_argument("--manifest", help="runs.tsv written by bench/core.sh")
    ap.add_argument("--warmup", type=int, default=10, help="ignore logged records with step <= this")
    ap.add_argument("--ref", default=REF_DEFAULT, help="run whose tokens/s/GPU is the ratio's denominator")
    ap.add_argument("--results", help="write one JSON line per run here")
    ap.add_argument("--metrics-out", help="write every run's metrics.jsonl records here, tagged with 'variant'")
    ap.add_argument("--table", help="write the markdown table here too")
    ap.add_argument("--title", default="", help="a line printed above the table")
    ap.add_argument("--second-ref", default=SECOND_REF, help="a second denominator, with its own ratio column")
    ap.add_argument("--spread", action="store_true", help="a min-max tokens/s/GPU column (steady records / steps)")
    ap.add_argument("--cross-call", action="store_true",
                    help="allow NAME=PATH runs from different calls (folders); the table says so")
    args = ap.parse_args(argv)

    pairs = parse_pairs(args.runs)
    if not args.cross_call:
        check_one_call(pairs)
    entries = (parse_manifest(args.manifest) if args.manifest else []) + pairs
    if not entries:
        ap.error("no runs: pass --manifest or NAME=PATH pairs")
    results = []
    for e in entries:
        try:
            results.append(summarize_entry(e, args.warmup))
        except Exception as err:  # one unreadable run must not lose the table
            results.append({"name": e.get("name", "?"), "kind": e.get("kind"), "rc": e.get("rc"),
                            "status": f"summarize error: {type(err).__name__}: {err}"})
    add_ratios(results, args.ref, args.second_ref)

    if args.results:
        with open(args.results, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            for e in entries:
                if e.get("metrics"):
                    for row in read_jsonl(e["metrics"]):
                        f.write(json.dumps({"variant": e["name"], **row}) + "\n")
    notes = render_notes(results, args.warmup)
    if args.cross_call:
        notes = ("- runs from different calls (--cross-call): ratios compare different machines or times\n"
                 + notes).strip()
    table = render_table(results, args.ref, args.second_ref, args.spread)
    text = "\n\n".join(x for x in (args.title, notes, table) if x)
    if args.table:
        Path(args.table).write_text(text.strip() + "\n")
    print(text.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
