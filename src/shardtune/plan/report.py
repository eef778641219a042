"""What `shardtune plan` prints: the candidates table, the pick, and `--check RUN_DIR`'s errors."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError
from shardtune.plan import Plan, describe
from shardtune.plan.memory import GIB
from shardtune.plan.search import Candidate

TERMS = (("parameters", "params"), ("master_weights", "master"), ("gradients", "grads"), ("optimizer", "optim"),
         ("gathered_parameters", "gather"), ("activations", "act"), ("logits", "logits"), ("buffers", "buf"))


# The table's checkpointing column: "+h" when the saved activations are on the host, "+a" when full checkpointing is
# around the compiled blocks where auto would put it inside (parallel.checkpoint_in_compile: false), "fullN" when it
# takes the first N blocks only (parallel.checkpoint_blocks); its strategy column: "+w" when the frozen base is whole
# on each GPU (parallel.shard_frozen: false), "+e" when the input embedding is in host memory
# (peft.offload_embedding), "+l" when the LM head is (peft.offload_head); "+t" when the MLPs run in tiles
# (parallel.tiled_mlp).
AC_SHORT = {"selective": "sel"}

def table(plan: Plan, show_all: bool = False) -> list[str]:
    rows = [c for c in plan.result.candidates if show_all or c.usable]
    head = (f"{'backend':<9} {'strategy':<12} {'offload':<9} {'ckpt':<6} {'mb':>3} {'GiB/GPU':>8} "
            + " ".join(f"{short:>6}" for _, short in TERMS) + f" {'host GiB':>8} {'tok/s/GPU':>10} {'MFU':>6}  fits")
    lines = [head]
    for c in rows:
        lines.append(_row(c, mark=_mark(plan, c)))
    if not rows:
        lines.append("(no candidate fits; --all lists them all)")
    return lines


def _mark(plan: Plan, c: Candidate) -> str:
    marks = []
    if plan.pick is not None and c.setting == plan.pick.setting:
        marks.append("<- pick")
    if c.setting == plan.configured.setting and not plan.auto:
        marks.append("<- config")
    return " ".join(marks)


def _row(c: Candidate, mark: str = "") -> str:
    s, mem = c.setting, c.memory
    terms = " ".join(f"{mem.terms.get(key, 0.0) / GIB:>6.1f}" for key, _ in TERMS)
    fits = "yes" if c.usable else ("host" if c.fits else "no")
    ac = f"b{s.memory_budget:g}" if s.budget_recompute else AC_SHORT.get(s.activation_checkpointing,
                                                                          s.activation_checkpointing)
    ac += str(s.checkpoint_blocks) if s.checkpoint_blocks is not None and s.activation_checkpointing == "full" else ""
    ac += "+h" if s.activation_offload else ""
    ac += "+t" if s.mlp_tiled else ""
    ac += "+a" if s.checkpoint_in_compile is False and s.compile and s.activation_checkpointing == "full" else ""
    strategy = (s.strategy + ("+w" if s.frozen_local else "") + ("+e" if s.embedding_offloaded else "")
                + ("+l" if s.head_offloaded else ""))
    return (f"{s.backend:<9} {strategy:<12} {s.offload:<9} {ac:<6} {s.micro_batch_size:>3} "
            f"{mem.total / GIB:>8.1f} {terms} {mem.host_total / GIB:>8.1f} {c.time.tokens_per_sec_per_gpu:>10,.0f} "
            f"{c.time.mfu:>6.1%}  {fits} {mark}").rstrip()


def summary_lines(plan: Plan) -> list[str]:
    hw, c = plan.hardware, plan.configured
    lines = [f"hardware   {hw.name}, {hw.memory_bytes / GIB:.1f} GiB per GPU "
             f"({c.setting.per_node} per node x {c.setting.nnodes} node(s)); usable {plan.result.capacity / GIB:.1f} "
             "GiB after the safety margin",
             f"pick       {plan.reason()}"]
    host = plan.result.host_capacity
    lines[0] += (f"; host {host / GIB:.0f} GiB per node" if host else
                 "; host memory not checked (--host-memory SIZE checks it)")
    if not plan.auto:
        lines.insert(1, f"config     {describe(c.setting)}: {c.memory.total / GIB:.1f} GiB per GPU predicted (peak at "
                        f"{c.memory.phase}), {c.time.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, "
                        f"{'fits' if c.usable else 'does NOT fit'}")
    if plan.auto:
        lines.append(f"auto       {', '.join(plan.auto)} -> {describe(plan.chosen().setting)}")
    for name, hint in (("float8", float8_hint(plan)), ("compile", compile_hint(plan)), ("liger", liger_hint(plan))):
        if hint:
            lines.append(f"{name:<10} {hint}")
    return lines


def compile_hint(plan: Plan) -> str:
    """parallel.compile=true where the chosen run leaves it off and it is predicted 5% faster or more."""
    alt = plan.alternatives.get("compile")
    c = plan.chosen()
    if alt is None or not alt.usable or alt.time.tokens_per_sec_per_gpu < 1.05 * c.time.tokens_per_sec_per_gpu:
        return ""
    return (f"parallel.compile=true: {alt.time.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU predicted "
            f"({alt.time.tokens_per_sec_per_gpu / c.time.tokens_per_sec_per_gpu - 1:+.0%}), "
            f"{alt.memory.total / GIB:.1f} GiB; each decoder block compiled once at the start")


def liger_hint(plan: Plan) -> str:
    """What liger-kernel would give where model.liger: auto cannot take it (not installed here)."""
    alt = plan.alternatives.get("liger")
    if alt is None:
        return ""
    c, s = plan.chosen(), alt.setting
    gain = alt.time.tokens_per_sec_per_gpu / c.time.tokens_per_sec_per_gpu - 1
    less = c.memory.total - alt.memory.total
    takes = " and ".join(["kernels"] * s.liger_kernels + ["fused loss"] * s.fused_loss)
    return (f"liger-kernel is not installed here; with it model.liger: auto takes Liger's {takes}: "
            f"{alt.time.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU predicted ({gain:+.0%}), "
            f"{alt.memory.total / GIB:.1f} GiB" + ("" if alt.usable else " (does NOT fit)")
            + (f" ({less / GIB:.1f} less: the logits are never made)" if s.fused_loss and less > 0 else "")
            + "; pip install liger-kernel (or -e '.[liger]') where the run starts")


def float8_hint(plan: Plan) -> str:
    """What float8 would change for the chosen run, priced: keeping LoRA's frozen float8 layers as their casts
    where tensorwise is on and peft.base_dtype names the compute dtype (auto keeps them where it can: the same
    numbers, less memory), else turning tensorwise on (opt-in) where it runs and is predicted 5% faster or more
    (float8 matmuls round differently from bf16's)."""
    c = plan.chosen()
    s = c.setting
    if s.float8 == "tensorwise" and s.peft == "lora" and s.base_dtype == s.precision and not s.dora \
            and s.frozen_local:
        kept = _priced(plan, s, base_dtype="float8")
        return (f"peft.base_dtype=float8: {kept.memory.total / GIB:.1f} GiB per GPU predicted (peak at "
                f"{kept.memory.phase}) against {c.memory.total / GIB:.1f}; the frozen float8 layers cast once")
    return _float8_speed_hint(plan, c)


def _priced(plan: Plan, s: Any, **changes: Any) -> Candidate:
    from dataclasses import replace

    from shardtune.plan.search import price

    return price(plan.shape, replace(s, **changes), plan.hardware, plan.result.capacity, plan.result.host_capacity)


def _float8_speed_hint(plan: Plan, c: Candidate) -> str:
    from shardtune.parallel import BACKENDS
    from shardtune.plan.hardware import FLOAT8_GPUS

    s = c.setting
    runs = "tensorwise" in BACKENDS[s.backend].supports.get("train.float8", ())  # the backend's own table
    if (plan.hardware.name not in FLOAT8_GPUS or not runs or s.float8 != "false" or s.precision != "bf16"
            or s.peft == "qlora" or s.tokens % 16):
        return ""
    f8 = _priced(plan, s, float8="tensorwise")
    gain = f8.time.tokens_per_sec_per_gpu / c.time.tokens_per_sec_per_gpu
    if gain < 1.05:
        return ""
    return (f"train.float8=tensorwise: {f8.time.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU predicted "
            f"({gain - 1:+.0%}), {f8.memory.total / GIB:.1f} GiB; the blocks' matmuls in float8 (opt-in; needs "
            "torchao)" + ("" if s.compile else ", with parallel.compile=true"))


def check_run(run_dir: str) -> list[str]:
    """Predicted (OUTPUT_DIR/plan.json) against measured (metrics.jsonl) for a finished run."""
    root = Path(run_dir)
    plan_file, metrics_file = root / "plan.json", root / "metrics.jsonl"
    for f in (plan_file, metrics_file):
        if not f.is_file():
            raise ShardtuneError(f"plan --check: {str(f)!r} does not exist; give the output dir of a shardtune run "
                                 "(it writes plan.json and metrics.jsonl)")
    try:
        predicted = json.loads(plan_file.read_text())["chosen"]
        records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError) as err:
        raise ShardtuneError(f"plan --check: cannot read {run_dir}: {err}") from None
    measured = measured_from(records)
    if not measured:
        raise ShardtuneError(f"plan --check: {str(metrics_file)!r} holds no training record yet")
    rows = [("peak allocated GiB", predicted["memory_gib"]["allocated"], measured["peak_allocated_gib"]),
            ("peak reserved GiB", predicted["memory_gib"]["reserved"], measured["peak_reserved_gib"]),
            ("tokens/s per GPU", predicted["tokens_per_sec_per_gpu"], measured["tokens_per_sec_per_gpu"])]
    out = [f"{'':<20} {'predicted':>12} {'measured':>12} {'error':>8}"]
    for name, p, m in rows:
        err = f"{(p - m) / m:+.1%}" if m else "-"
        out.append(f"{name:<20} {p:>12,.2f} {m:>12,.2f} {err:>8}")
    return out


def measured_from(records: list[dict[str, Any]]) -> dict[str, float]:
    """Peak memory over every training record; tokens/s per GPU as the median of the records after the
    first (warm-up, compile) that include no checkpoint save."""
    train = [r for r in records if not r.get("eval") and "tokens_per_sec_per_device" in r]
    if not train:
        return {}
    steady = [r for r in train[1:] if "checkpoint_s" not in r] or train
    return {"peak_allocated_gib": max(r["peak_mem_gib"] for r in train),
            "peak_reserved_gib": max(r.get("peak_reserved_gib", r["peak_mem_gib"]) for r in train),
            "tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec_per_device"] for r in steady)}
