"""`shardtune report RUN_DIR [RUN_DIR ...] [--out DIR]`: one HTML page and its PNG plots for one or more runs,
read from what a run writes (config.yaml, plan.json, metrics.jsonl, summary.json). Several runs are overlaid on
the same axes. `train` writes one into OUTPUT_DIR/report at the end (`log.report`).

The page is self-contained: no scripts, no styles or fonts from elsewhere; the PNGs sit next to it. Plots are
drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import contextlib
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError
from shardtune.redact import redact_text

REPORT_DIR = "report"  # OUTPUT_DIR/report, written at the end of `train`
PAGE = "report.html"
MIB = 2**20
INSTALL_HINT = "pip install matplotlib (or, in a checkout, pip install -e '.[report]')"


@dataclass
class RunData:
    """One run directory's files, as the report needs them."""

    path: Path
    name: str
    config: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl's training records
    evals: list[dict[str, Any]] = field(default_factory=list)  # ... and its eval records


def read_run(path: Path, name: str | None = None) -> RunData:
    """A run directory's files; refuses a directory without metrics.jsonl (one line, exit 2 at the CLI)."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ShardtuneError(f"report: {str(path)!r} has no metrics.jsonl; give the output dir of a shardtune run "
                             "(train.output_dir), with log.jsonl true")
    run = RunData(path=path, name=name or path.name)
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        (run.evals if record.get("eval") else run.train).append(record)
    if (path / "config.yaml").is_file():
        # Masked again here: a config.yaml written before shardtune masked it may hold a URL's credentials.
        run.config = redact_text((path / "config.yaml").read_text())
    for attr, fname in (("plan", "plan.json"), ("summary", "summary.json")):
        f = path / fname
        if f.is_file():
            with contextlib.suppress(ValueError):  # a partial file of a run that is still being written
                setattr(run, attr, json.loads(f.read_text()))
    return run


def _names(paths: list[Path]) -> list[str]:
    """Short distinct labels: the folder name, with its parent where two runs share a name."""
    names = [p.name or str(p) for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]


def write_report(run_dirs: list[Path], out: Path) -> Path:
    """Render the page and its plots for `run_dirs` into `out` (created); returns the page's path."""
    if not run_dirs:
        raise ShardtuneError("report: give at least one run directory")
    for d in run_dirs:
        if not d.is_dir():
            raise ShardtuneError(f"report: {str(d)!r} is not a directory; give the output dir of a shardtune run")
    try:
        import matplotlib
    except ImportError:
        raise ShardtuneError(f"report: matplotlib is not installed; {INSTALL_HINT}") from None
    matplotlib.use("Agg", force=True)  # files only; never a window, also where a display is set
    runs = [read_run(d, n) for d, n in zip(run_dirs, _names(run_dirs), strict=True)]
    if out.exists() and not out.is_dir():
        raise ShardtuneError(f"report: --out {str(out)!r} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    plots = [(title, fname) for title, fname, draw in PLOTS if draw(runs, out / fname)]
    page = out / PAGE
    page.write_text(_html(runs, plots))
    return page


# ---- plots: each returns False (and writes nothing) when no run has its data ---------------------------------

def _figure(rows: int = 1) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), dpi=100, squeeze=False, sharex=True)
    return fig, [a for row in axes for a in row]


def _legend(ax: Any) -> None:
    """Outside the axes, on the right: with several runs overlaid it would cover the curves."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _save(fig: Any, path: Path) -> bool:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # steps are whole numbers (the communication plot's x axis names collectives)
        if ax.get_xlabel().startswith("optimizer step"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_loss(runs: list[RunData], path: Path) -> bool:
    if not any(r.train for r in runs):
        return False
    fig, (ax,) = _figure()
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax.plot(*_series(run.train, "loss"), color=color, label=f"{run.name} train")
        steps, evals = _series(run.evals, "eval_loss")
        if steps:
            ax.plot(steps, evals, color=color, linestyle="--", marker="o", label=f"{run.name} eval")
    ax.set(title="Loss", xlabel="optimizer step", ylabel="loss (nats per target token)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def plot_throughput(runs: list[RunData], path: Path) -> bool:
    if not any(_series(r.train, "tokens_per_sec_per_device")[0] for r in runs):
        return False
    has_mfu = any(_series(r.train, "mfu")[0] for r in runs)  # None on CPU: no peak FLOP rate to divide by
    fig, axes = _figure(2 if has_mfu else 1)
    top = axes[0]
    for i, run in enumerate(runs):
        top.plot(*_series(run.train, "tokens_per_sec_per_device"), color=f"C{i}", marker=".", label=run.name)
        if has_mfu:
            steps, mfu = _series(run.train, "mfu")
            axes[1].plot(steps, [100 * m for m in mfu], color=f"C{i}", marker=".", label=run.name)
        predicted = run.plan.get("chosen", {}).get("tokens_per_sec_per_gpu")
        if predicted and run.plan.get("hardware", {}).get("name") != "cpu":  # CPU rates only rank candidates
            top.axhline(predicted, color=f"C{i}", linestyle=":", label=f"{run.name}: planner's prediction")
    top.set(title="Throughput" + ("" if has_mfu else " (no MFU: no peak FLOP rate known for this device)"),
            ylabel="tokens/s per device")
    if has_mfu:
        axes[1].set(title="Model FLOPs utilisation", ylabel="MFU (%)")
    axes[-1].set_xlabel("optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def plot_memory(runs: list[RunData], path: Path) -> bool:
    if not any(_series(r.train, "peak_mem_gib")[0] for r in runs):
        return False
    fig, (ax,) = _figure()
    for i, run in enumerate(runs):
        color = f"C{i}"
        ranks = [r for r in run.train if isinstance(r.get("peak_mem_gib_ranks"), list)]
        if ranks:  # one line per rank where the run logged each rank's peak
            for k in range(len(ranks[0]["peak_mem_gib_ranks"])):
                ax.plot([r["step"] for r in ranks], [r["peak_mem_gib_ranks"][k] for r in ranks], color=color,
                        alpha=0.35 + 0.65 / (k + 1), marker=".", label=f"{run.name} rank {k} allocated")
        else:
            ax.plot(*_series(run.train, "peak_mem_gib"), color=color, marker=".",
                    label=f"{run.name} allocated (max over ranks)")
        ax.plot(*_series(run.train, "peak_reserved_gib"), color=color, linestyle="--",
                label=f"{run.name} reserved (max over ranks)")
        chosen, hw = run.plan.get("chosen", {}), run.plan.get("hardware", {})
        if chosen.get("memory_gib", {}).get("allocated") is not None:
            ax.axhline(chosen["memory_gib"]["allocated"], color=color, linestyle=":",
                       label=f"{run.name}: planner's prediction (allocated)")
        if hw.get("memory_gib") and hw.get("name") != "cpu":  # a CPU's 'capacity' is host RAM: off the scale
            ax.axhline(hw["memory_gib"], color="black", linewidth=2, label=f"{hw.get('name')} capacity")
    on_cpu = all(r.plan.get("hardware", {}).get("name") == "cpu" for r in runs)
    ax.set(title="Peak memory per rank" + (" (a CPU run: the process's resident set)" if on_cpu else ""),
           xlabel="optimizer step", ylabel="GiB")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def plot_comm(runs: list[RunData], path: Path) -> bool:
    rows = [(run, run.summary.get("comm") or {}) for run in runs]
    kinds = sorted({k for _, c in rows for k in (c.get("bus_bytes_per_step") or {})}
                   | {k for _, c in rows for k in (c.get("predicted_bus_bytes_per_step") or {})})
    if not kinds:
        return False
    fig, (ax,) = _figure()
    width = 0.8 / (2 * len(rows))
    for i, (run, c) in enumerate(rows):
        measured = c.get("bus_bytes_per_step") or {}
        predicted = c.get("predicted_bus_bytes_per_step") or {}
        base = [x + (2 * i) * width - 0.4 + width / 2 for x in range(len(kinds))]
        ax.bar(base, [measured.get(k, 0) / MIB for k in kinds], width, color=f"C{i}", label=f"{run.name} measured")
        ax.bar([b + width for b in base], [predicted.get(k, 0) / MIB for k in kinds], width, color=f"C{i}",
               alpha=0.4, hatch="//", label=f"{run.name} planner")
    ax.set_xticks(range(len(kinds)), [_comm_tick(k, rows) for k in kinds])
    ax.set(title="Communication per optimizer step, each rank (ring bus bytes)", xlabel="collective",
           ylabel="MiB per step per rank")
    ax.grid(alpha=0.3, axis="y")
    _legend(ax)
    return _save(fig, path)


def _comm_tick(kind: str, rows: list[tuple[RunData, dict]]) -> str:
    """The collective's name, with each run's achieved bus bandwidth in its profiled steps (log.profile, GPUs)."""
    rates = [f"{r['bus_bytes_per_s'] / 1e9:.0f} GB/s" for _, c in rows
             if "bus_bytes_per_s" in (r := (c.get("profiled") or {}).get(kind, {}))]
    return kind.replace("_", "-") + ("\n" + ", ".join(rates) if rates else "")


def plot_checkpoints(runs: list[RunData], path: Path) -> bool:
    if not any(_series(r.train, "checkpoint_s")[0] for r in runs):
        return False
    fig, (ax,) = _figure()
    for i, run in enumerate(runs):
        ax.plot(*_series(run.train, "checkpoint_s"), color=f"C{i}", marker="o", linestyle="none", label=run.name)
    ax.set(title="Time the loop waited for checkpoint saves", xlabel="optimizer step (logged interval's end)",
           ylabel="seconds")
    waits = [w for r in runs for w in _series(r.train, "checkpoint_s")[1]]
    ax.set_ylim(0, 1.15 * max(waits))  # room above the longest wait's marker
    ax.set_xlim(0, 1.02 * max(step for r in runs for step in _series(r.train, "loss")[0] or [1]))  # the whole run
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


PLOTS = [("Loss and eval loss", "loss.png", plot_loss),
         ("Throughput and MFU", "throughput.png", plot_throughput),
         ("Memory", "memory.png", plot_memory),
         ("Communication", "comm.png", plot_comm),
         ("Checkpoint saves", "checkpoints.png", plot_checkpoints)]


# ---- the page ---------------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return "—" if v is None else str(v)


def _table(rows: list[tuple[str, Any]]) -> str:
    # Values are paths and settings as the run wrote them: masked like the config (a URL's credentials).
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(redact_text(_fmt(v)))}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def _plan_table(plan: dict[str, Any]) -> str:
    predicted, measured, error = plan.get("predicted", {}), plan.get("measured", {}), plan.get("error", {})
    head = "<tr><th></th><th>predicted</th><th>measured</th><th>error</th></tr>"
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td><td>{_fmt(measured.get(k))}</td>"
                   f"<td>{f'{error[k]:+.1%}' if k in error else '—'}</td></tr>" for k, v in predicted.items())
    return f"<p>Planner ({html.escape(str(plan.get('hardware')))}) against this run:</p><table>{head}{body}</table>"


def checkpoints_dir(run: RunData) -> Path:
    """Where the run's checkpoints went: its config.yaml's checkpoint.dir, else RUN/checkpoints (the rule of
    checkpoint.layout.checkpoint_root, with the directory the report was given standing for train.output_dir, so
    a run folder that was moved is still found)."""
    import yaml

    from shardtune.checkpoint.layout import checkpoint_root
    from shardtune.config import CheckpointConfig

    try:
        section = (yaml.safe_load(run.config) or {}).get("checkpoint") or {}
    except (yaml.YAMLError, AttributeError):  # not a mapping, or cut short: the default
        section = {}
    where = section.get("dir") if isinstance(section, dict) else None
    return checkpoint_root(CheckpointConfig(dir=where if isinstance(where, str) else None), run.path)


def _run_section(run: RunData) -> str:
    s = run.summary
    last = run.train[-1] if run.train else {}
    rows = [("run directory", str(run.path)), ("strategy", s.get("strategy")), ("processes", s.get("world_size")),
            ("precision", s.get("precision")), ("parameters", s.get("params")),
            ("steps", f"{last.get('step', '—')} of {s.get('steps', '—')}"), ("final loss", s.get("final_loss")),
            ("training time (s)", s.get("train_seconds")), ("model", s.get("model_dir")),
            ("adapter", s.get("adapter_dir")), ("checkpoints", str(checkpoints_dir(run))),
            ("stopped by", s.get("stopped_by"))]
    if not s:
        rows.append(("summary.json", "not written (the run has not finished)"))
    parts = [f"<h2>{html.escape(run.name)}</h2>", _table([r for r in rows if r[1] is not None])]
    if s.get("plan"):
        parts.append(_plan_table(s["plan"]))
    elif run.plan.get("chosen"):
        c = run.plan["chosen"]
        parts.append(_table([("planner: peak allocated GiB", c.get("memory_gib", {}).get("allocated")),
                             ("planner: tokens/s per GPU", c.get("tokens_per_sec_per_gpu"))]))
    if run.config:
        parts.append(f"<details open><summary>Resolved config (config.yaml)</summary>"
                     f"<pre class=\"config\">{html.escape(run.config)}</pre></details>")
    return "\n".join(parts)


STYLE = """body{font-family:sans-serif;max-width:60em;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left}
th{background:#f4f4f4;font-weight:normal}pre{background:#f8f8f8;padding:.6em;overflow:auto;font-size:85%}
img{max-width:100%;border:1px solid #eee}"""


def _html(runs: list[RunData], plots: list[tuple[str, str]]) -> str:
    title = "shardtune report: " + ", ".join(r.name for r in runs)
    figures = "\n".join(f"<h2>{html.escape(t)}</h2><img src=\"{html.escape(f)}\" alt=\"{html.escape(t)}\">"
                        for t, f in plots)
    sections = "\n".join(_run_section(r) for r in runs)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{sections}\n{figures}\n"
            "</body></html>\n")
