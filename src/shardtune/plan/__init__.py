"""The planner: per-GPU memory and step time for every way to run a config, the fastest that fits, and
the refusal of what cannot fit, before any process starts. A pure function of (model config, run config,
hardware); it reads config.json only (the model is built on the meta device) and needs no GPU.

    shape = model_shape(hf_config)            plan/shape.py     parameters by role, widths
    gpu_memory(shape, setting)                plan/memory.py    bytes per term, peak phase, host memory
    step_time(shape, setting, hardware)       plan/speed.py     FLOPs, collective bytes, offload
    search(shape, setting, hardware)          plan/search.py    every candidate, the pick
    Hardware                                  plan/hardware.py  ceilings per GPU type, `shardtune calibrate`
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError
from shardtune.parallel.fsdp2 import frozen_whole
from shardtune.plan.memory import GIB
from shardtune.plan.search import (
    MICRO_BATCHES,
    SAFETY_MARGIN,
    Candidate,
    Search,
    search,
    smallest_fixes,
)
from shardtune.plan.setting import Setting, host_embedding_asked, setting_from_config
from shardtune.plan.shape import ModelShape, model_shape

__all__ = ["ModelShape", "Plan", "Setting", "make_plan", "refusal", "resolve_auto", "resolve_hardware"]


@dataclass
class Plan:
    hardware: Any
    shape: ModelShape
    result: Search
    auto: tuple[str, ...]  # the config keys left to the planner
    # Opt-in settings the chosen run goes without, priced with it (alternatives): "compile", "liger"
    alternatives: dict[str, Candidate] = field(default_factory=dict)

    @property
    def pick(self) -> Candidate | None:
        return self.result.pick

    @property
    def configured(self) -> Candidate:
        return self.result.configured

    def chosen(self) -> Candidate:
        """The run that will happen: the pick for what the config leaves to `auto`, the config elsewhere."""
        if not self.auto or self.pick is None:
            return self.configured
        return self.pick

    def reason(self) -> str:
        pick = self.pick
        if pick is None:
            return "nothing fits"
        return (f"fastest that fits: {describe(pick.setting)}, {pick.time.tokens_per_sec_per_gpu:,.0f} tokens/s per "
                f"GPU predicted, {pick.memory.total / GIB:.1f} of {self.hardware.memory_bytes / GIB:.1f} GiB")

    def to_json(self, all_candidates: bool = True) -> dict[str, Any]:
        cands = self.result.candidates if all_candidates else [c for c in self.result.candidates if c.usable]
        hw = self.hardware
        return {
            "hardware": {"name": hw.name, "memory_gib": round(hw.memory_bytes / GIB, 2),
                         "safety_margin": SAFETY_MARGIN},
            "model": {"model_type": self.shape.model_type, "params": self.shape.params,
                      "trainable_params": self.shape.params if self.configured.setting.peft == "none"
                      else self.shape.lora_params},
            "world": self.configured.setting.world, "per_node": self.configured.setting.per_node,
            "candidates": [c.to_json() for c in cands],
            "configured": self.configured.to_json(),
            "pick": self.pick.to_json() if self.pick else None,
            "chosen": self.chosen().to_json(),
            "auto": list(self.auto),
            "reason": self.reason(),
            "refused": {"/".join(k[:3]) + ("/activation_offload" if k[3] else ""): v
                        for k, v in self.result.refused.items()},
            "alternatives": {name: c.to_json() for name, c in self.alternatives.items()},
        }


def describe(s: Setting) -> str:
    parts = [f"{s.backend} {s.strategy}"]
    if s.offload != "none":
        parts.append(f"offload {s.offload}")
    if s.budget_recompute:
        parts.append(f"activation memory budget {s.memory_budget:g}")
    else:
        parts.append("no checkpointing" if s.activation_checkpointing == "none" else
                     f"checkpointing {s.activation_checkpointing}")
        if s.checkpoint_blocks is not None and s.activation_checkpointing == "full":
            parts[-1] += f" of the first {s.checkpoint_blocks} blocks"
        if s.compile and s.activation_checkpointing == "full":
            parts[-1] += " inside the compiled blocks" if s.checkpoint_traced else " around the compiled blocks"
    if s.activation_offload:
        parts.append("saved activations in host memory")
    if s.mlp_tiled:
        parts.append(f"MLPs in tiles of {s.tiled_mlp:,} tokens")
    if s.frozen_local:
        parts.append("frozen base whole on each GPU")
    if s.embedding_offloaded:
        parts.append("input embedding in host memory")
    if s.head_offloaded:
        parts.append("LM head in host memory")
    if s.one_gpu_direct:
        parts.append("without FSDP2 (one_gpu direct)" + (", the compiled update" if s.compiled_update_runs else ""))
    parts.append(f"micro-batch {s.micro_batch_size}")
    if s.liger_kernels or s.fused_loss:
        parts.append("liger " + " + ".join(["kernels"] * s.liger_kernels + ["fused loss"] * s.fused_loss))
    return ", ".join(parts)


def auto_keys(cfg: Any) -> tuple[str, ...]:
    keys = []
    if cfg.parallel.strategy == "auto":
        keys.append("parallel.strategy")
    if cfg.train.micro_batch_size == "auto":
        keys.append("train.micro_batch_size")
    return tuple(keys)


def cpu_hardware(per_node: int) -> Any:
    """A CPU machine seen as a 'GPU' per process: its share of host memory; rates only rank candidates."""
    from shardtune.plan.hardware import Hardware, local_host_memory

    total = local_host_memory() or 16 * GIB
    return Hardware(name="cpu", memory_bytes=int(total // max(1, per_node)), bf16_flops=1e12, matmul_efficiency=0.5,
                    intra_node_bus_bytes_per_s=5e9, inter_node_bus_bytes_per_s=1e9, h2d_bytes_per_s=1e10,
                    host_adam_params_per_s=5e8, hbm_bytes_per_s=5e10)


def resolve_hardware(gpu: str | None = None, gpu_memory: str | None = None, calibration: str | None = None,
                     host_memory: str | None = None, local_host: bool = False) -> Any:
    """The GPU to plan for: `--gpu` (the table), else the local GPU, else None. A calibration file
    (`shardtune calibrate`; --calibration or the default location) replaces the table's rates when it was
    measured on the same GPU type; `--gpu-memory` replaces the memory. Host memory per node: `--host-memory`,
    else this machine's when the GPU is the local one or the run starts here (`local_host`), else unknown (a
    GPU type named on a login node: the planner does not check host memory then)."""
    from dataclasses import replace

    from shardtune.plan import hardware as hwmod

    try:
        hw = hwmod.lookup(gpu) if gpu else hwmod.detect()
    except ShardtuneError as err:
        raise ShardtuneError(f"--gpu: {err}") from None
    path = Path(calibration) if calibration else hwmod.calibration_path()
    if calibration and not path.is_file():
        raise ShardtuneError(f"--calibration: {str(path)!r} does not exist; run `shardtune calibrate --out "
                             f"{path}` on the GPU machine, or leave the flag out")
    if path.is_file():
        measured = hwmod.load_calibration(path)
        if hw is None or measured.name == hw.name:
            hw = measured if hw is None else replace(measured, memory_bytes=hw.memory_bytes,
                                                     host_memory_bytes=hw.host_memory_bytes)
    if gpu_memory:
        if hw is None:
            raise ShardtuneError("--gpu-memory: also name the GPU type with --gpu (e.g. --gpu h100 --gpu-memory "
                                 "80GiB); its rates come from the table")
        hw = replace(hw, memory_bytes=hwmod.parse_memory(gpu_memory))
    if host_memory:
        if hw is None:
            raise ShardtuneError("--host-memory: also name the GPU type with --gpu (e.g. --gpu h100 --host-memory "
                                 "2TiB)")
        hw = replace(hw, host_memory_bytes=hwmod.parse_memory(host_memory, "host memory", "2TiB or 1000GB"))
    elif hw is not None and local_host and hw.host_memory_bytes is None:
        hw = replace(hw, host_memory_bytes=hwmod.local_host_memory())
    return hw


def supported_by(cfg: Any) -> Any:
    """setting -> None if the backends can run it, else why not (validate's own rules, no process; and the
    memory-snapshot refusal, which depends on the setting's compile and checkpointing)."""
    from shardtune.parallel import check_combination

    def check(s: Setting) -> str | None:
        if s.compile and snapshot_breaks_recompute(cfg.log.memory_snapshot, s.activation_checkpointing):
            return ("log.memory_snapshot: recording breaks the recompute of compiled blocks "
                    "(pytorch/pytorch#179536; validate.check_memory_snapshot)")
        variant = config_for(cfg, s)
        try:
            check_combination(variant, s.per_node, candidate=True, nnodes=s.nnodes)
        except ShardtuneError as err:
            return str(err)
        return None

    return check


def config_for(cfg: Any, s: Setting) -> Any:
    """`cfg` with the setting's knobs written in."""
    new = cfg.model_copy(deep=True)
    p, t = new.parallel, new.train
    write_strategy(p, s)
    if s.offload_embedding != host_embedding_asked(new.peft.offload_embedding):
        new.peft.offload_embedding = s.offload_embedding
    write_head(new.peft, s)
    p.compile = s.compile  # the search keeps the config's; an alternative (alternatives) may not
    if s.offload == "none" or not s.nvme:
        p.offload_nvme_path = None
    t.micro_batch_size = s.micro_batch_size
    if s.strategy != "hsdp":
        p.shard_size = "auto"
    if not s.rules.keeps_deepspeed_section:
        new.deepspeed = {}
    return new


def write_strategy(parallel: Any, s: Setting) -> None:
    """The knobs `parallel.strategy: auto` picks, written into `parallel` as the setting runs them."""
    # first out, last in: the config's check refuses checkpoint_blocks beside none or selective, and the tiles beside
    # selective, a budget or the checkpoint inside compiled blocks
    parallel.checkpoint_blocks = parallel.tiled_mlp = None
    parallel.backend, parallel.strategy, parallel.offload = s.backend, s.strategy, s.offload
    parallel.activation_offload = s.activation_offload
    set_checkpointing(parallel, s)
    parallel.checkpoint_blocks = s.checkpoint_blocks
    parallel.checkpoint_in_compile = s.checkpoint_in_compile
    parallel.tiled_mlp = s.tiled_mlp
    _say_shard_frozen(parallel, s)


def write_head(peft: Any, s: Setting) -> None:
    """peft.offload_head as the setting runs it: true where the search took it; auto, which means off, stays."""
    if s.offload_head != (peft.offload_head is True):
        peft.offload_head = s.offload_head


def set_checkpointing(parallel: Any, s: Setting) -> None:
    """parallel.activation_checkpointing and activation_memory_budget as the setting runs them (a searched variant
    with checkpointing, or without compile, runs without a budget), in the order the config's check allows: never
    a budget beside checkpointing."""
    if s.budget_applies:
        parallel.activation_checkpointing = s.activation_checkpointing
        parallel.activation_memory_budget = s.memory_budget
    else:
        parallel.activation_memory_budget = None
        parallel.activation_checkpointing = s.activation_checkpointing


def _say_shard_frozen(parallel: Any, s: Setting) -> None:
    """Write the setting's parallel.shard_frozen where the config's value (auto, resolved for the setting's world)
    would give the other one; leave auto where it gives the same."""
    if s.shard_frozen == frozen_whole(parallel, s.world):  # sharded where the config keeps whole, or the reverse
        parallel.shard_frozen = s.shard_frozen


def free_knobs(cfg: Any) -> set[str]:
    """Setting fields the planner may choose: the strategy's (backend, offload and checkpointing too, unless the
    config sets them) under `parallel.strategy: auto`, and the micro-batch under its `auto`. peft.offload_embedding's
    auto is a rule, not a search (the host wherever it runs: under 1% slower, measured), so the pick keeps it;
    peft.offload_head's auto is the search's (2.1% slower: taken only where it is what fits)."""
    free = set()
    if cfg.parallel.strategy == "auto":
        free.add("strategy")
        chosen = cfg.parallel.model_fields_set | ({"activation_checkpointing"}  # none: the budget recomputes
                                                  if cfg.parallel.activation_memory_budget is not None else set())
        free |= {k for k in ("backend", "offload", "activation_checkpointing", "activation_offload",
                             "checkpoint_in_compile") if k not in chosen}
        if "activation_checkpointing" in free:
            # a budget is a way of checkpointing (none with compile's recompute), and so are the first N blocks
            # and the MLPs' tiles
            free |= {"memory_budget", "checkpoint_blocks", "tiled_mlp"}
        if cfg.parallel.shard_frozen == "auto":
            free.add("shard_frozen")
        if cfg.peft.offload_head == "auto":
            free.add("offload_head")
    if cfg.train.micro_batch_size == "auto":
        free.add("micro_batch_size")
    return free


def make_plan(cfg: Any, hf_config: Any, hardware: Any, *, world: int, per_node: int,
              all_micro_batches: bool = False) -> Plan:
    """Price every way to run `cfg` on `world` processes (`per_node` per node) of `hardware`. The pick is the
    fastest that fits among those that change only what the config leaves to `auto` (everything, when
    nothing is auto: then it is advice)."""
    auto = auto_keys(cfg)
    targets = cfg.peft.target_modules if cfg.peft.target_modules != "auto" else None
    shape = model_shape(hf_config, targets, cfg.peft.r)
    base = setting_from_config(cfg, world, per_node, liger=liger_applies(cfg, hf_config, hardware))
    mbs = MICRO_BATCHES if "train.micro_batch_size" in auto or all_micro_batches else None
    # Host memory per node where it is known (resolve_hardware): the local machine's, or --host-memory. A GPU type
    # named from the table on another machine (a login node) has an unknown host: not checked.
    host = float(hardware.host_memory_bytes) if getattr(hardware, "host_memory_bytes", None) else None
    result = search(shape, base, hardware, supported=supported_by(cfg), micro_batches=mbs, host_capacity=host)
    free = free_knobs(cfg)
    if free:
        keep = [c for c in result.candidates if c.usable and _only(base, c.setting, free)]
        result.pick = max(keep, key=lambda c: (c.time.tokens_per_sec_per_gpu, -c.memory.total)) if keep else None
    plan = Plan(hardware, shape, result, auto)
    plan.alternatives = alternatives(cfg, hf_config, plan)
    return plan


def alternatives(cfg: Any, hf_config: Any, plan: Plan) -> dict[str, Candidate]:
    """The chosen run priced with what it goes without on a GPU: `compile` (parallel.compile=true, where the backend
    runs it and nothing in the config would refuse it), `liger` (Liger's kernels and fused loss as model.liger:
    auto takes them, where auto cannot because liger-kernel is not installed here). `shardtune plan` prints them
    (plan/report.py)."""
    from shardtune.models.liger_rules import auto_would_take, head_adapted, liger_installed, liger_kernels_wanted
    from shardtune.plan.search import price

    s, out = plan.chosen().setting, {}
    if getattr(plan.hardware, "name", "") == "cpu":
        return out
    if not s.compile:
        kernels = s.liger_kernels and liger_kernels_wanted(cfg.model.liger, True)
        compiled = s.replace(compile=True, liger_kernels=kernels)
        if supported_by(cfg)(compiled) is None:
            out["compile"] = compiled
    adapted_head = head_adapted(cfg.peft.method, cfg.peft.target_modules)
    if not liger_installed() and auto_would_take(cfg.model.liger, "cuda", getattr(hf_config, "model_type", ""),
                                                 compiled=s.compile, adapted_head=adapted_head):
        out["liger"] = s.replace(fused_loss=not adapted_head, liger_kernels=liger_kernels_wanted("auto", s.compile))
    return {name: price(plan.shape, alt, plan.hardware, plan.result.capacity, plan.result.host_capacity)
            for name, alt in out.items()}


def snapshot_breaks_recompute(memory_snapshot: list[int] | None, activation_checkpointing: str) -> bool:
    """Whether recording log.memory_snapshot breaks compiled blocks' recompute (validate.check_memory_snapshot):
    a recording, checkpointing and PyTorch 2.11 or later. The planner asks it before it advises compile; the
    version comes from the package metadata, so `plan` still does not import torch."""
    from importlib.metadata import version

    from packaging.version import Version

    return (memory_snapshot is not None and activation_checkpointing != "none"
            and Version(version("torch")).release >= (2, 11))


def liger_applies(cfg: Any, hf_config: Any, hardware: Any) -> bool:
    """Whether model.liger applies to the run on `hardware` (a GPU; the loop decides the same with
    models.liger_rules.use_liger on the machine it runs on): auto counts only where liger-kernel is installed here."""
    from shardtune.models.liger_rules import LIGER_MODEL_TYPES, liger_installed

    setting = cfg.model.liger
    if setting is False or getattr(hardware, "name", "") == "cpu":
        return False
    if getattr(hf_config, "model_type", "") not in LIGER_MODEL_TYPES:
        return False
    return setting is True or setting == "loss" or liger_installed()


def _only(a: Setting, b: Setting, free: set[str]) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in a.knobs() if k not in free)


def refusal(plan: Plan) -> str | None:
    """One line when the run as configured does not fit, naming the smallest changes that do."""
    chosen = plan.chosen()
    if chosen.usable:
        return None
    hw = plan.hardware
    if not chosen.fits:
        head = (f"predicted {chosen.memory.total / GIB:.0f} GiB per GPU > {plan.result.capacity / GIB:.0f} GiB usable "
                f"on {hw.name} ({hw.memory_bytes / GIB:.0f} GiB less the {SAFETY_MARGIN:.0%} margin)")
    else:
        head = (f"predicted {chosen.memory.host_total / GIB:.0f} GiB of host memory per node > "
                f"{(plan.result.host_capacity or 0) / GIB:.0f} GiB (this machine's, or --host-memory)")
    fixes = smallest_fixes(plan.result)
    if len(fixes) < 2:
        fixes = (fixes + _smaller_micro_batches(plan))[:2]
    if not fixes:
        return f"{head}: nothing the planner tried fits; use more GPUs{_peft_hint(plan)}{logits_hint(plan)}, or --force"
    said = [" ".join(f"{k}={_config_value(v)}" for k, v in diff.items()) + f" fits ({c.memory.total / GIB:.0f} GiB)"
            for diff, c in fixes]
    return f"{head}: {', or '.join(said)}; --force runs anyway"


def _config_value(v: Any) -> str:
    """A value as a command-line override writes it: null unsets (the budget), booleans in YAML's spelling."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _peft_hint(plan: Plan) -> str:
    peft = plan.configured.setting.peft
    return {"none": ", peft.method=lora or qlora", "lora": ", peft.method=qlora"}.get(peft, "")


def logits_hint(plan: Plan) -> str:
    """", model.liger=loss ..." when the plain loss's logits are a fifth or more of the leanest candidate's memory
    (long sequences, large vocabularies) and Liger's fused loss, which never makes them, applies to the model."""
    from shardtune.models.liger_rules import LIGER_MODEL_TYPES

    leanest = min(plan.result.candidates or [plan.configured], key=lambda c: c.memory.total)
    logits = leanest.memory.terms.get("logits", 0.0)
    if leanest.setting.fused_loss or plan.shape.model_type not in LIGER_MODEL_TYPES or \
            logits < 0.2 * leanest.memory.allocated:
        return ""
    return (f", model.liger=loss (Liger's fused loss never makes the {logits / GIB:.0f} GiB of logits; "
            "pip install liger-kernel)")


def _smaller_micro_batches(plan: Plan) -> list[tuple[dict[str, Any], Candidate]]:
    """Fixes that split the micro-batch and accumulate more, keeping the global batch (the config fixed the
    micro-batch, so the search did not vary it)."""
    from shardtune.plan.search import price, smallest_fixes

    base = plan.configured.setting
    per_step = base.micro_batch_size * base.grad_accum
    out: list[tuple[dict[str, Any], Candidate]] = []
    for mb in (m for m in (8, 4, 2, 1) if m < base.micro_batch_size and per_step % m == 0):
        extended = Search([], plan.configured, None, plan.result.capacity, plan.result.host_capacity)
        for c in plan.result.candidates:
            s = c.setting.replace(micro_batch_size=mb, grad_accum=per_step // mb)
            extended.candidates.append(price(plan.shape, s, plan.hardware, extended.capacity, extended.host_capacity))
        for diff, c in smallest_fixes(extended):
            diff["train.grad_accum"] = per_step // mb
            out.append((diff, c))
        if out:
            break
    return out


def resolve_auto(cfg: Any, hf_config: Any, hardware: Any, *, world: int, per_node: int,
                 force: bool = False) -> tuple[Any, Plan]:
    """The config with `auto` strategy / micro-batch replaced by the pick, and its plan; refuses a run that
    is predicted not to fit (unless `force`)."""
    hw = hardware or cpu_hardware(per_node)
    plan = make_plan(cfg, hf_config, hw, world=world, per_node=per_node)
    if plan.auto and plan.pick is None and not force:
        from shardtune.parallel import check_cudagraphs, check_direct_only, cudagraphs_rule_out_checkpointing

        check_cudagraphs(cfg.parallel)  # checkpointing set with CUDA graphs: that refusal, not "nothing fits"
        check_direct_only(cfg, world)  # what only one GPU runs, on several processes: that refusal too
        graphs = cudagraphs_rule_out_checkpointing(cfg.parallel)
        raise ShardtuneError(f"{', '.join(plan.auto)}: auto, but no way to run this config fits on {hw.name} "
                             f"({hw.memory_bytes / GIB:.0f} GiB per GPU)"
                             + (" without activation checkpointing, which CUDA graphs rule out (pytorch/pytorch"
                                "#154306); use parallel.compile_mode=default, more GPUs" if graphs else
                                "; use more GPUs") + f"{_peft_hint(plan)}"
                             f"{logits_hint(plan)}, a shorter train.seq_len, or set the strategy and --force")
    if hardware is not None and not force:
        line = refusal(plan)
        if line:
            raise ShardtuneError(line)
    chosen = plan.chosen()
    return config_for_auto(cfg, chosen.setting, plan.auto), plan


def config_for_auto(cfg: Any, s: Setting, auto: tuple[str, ...]) -> Any:
    if not auto:
        return cfg
    new = cfg.model_copy(deep=True)
    if "parallel.strategy" in auto:
        write_strategy(new.parallel, s)
        write_head(new.peft, s)
    if "train.micro_batch_size" in auto:
        new.train.micro_batch_size = s.micro_batch_size
    return new


def auto_overrides(cfg: Any, auto: tuple[str, ...]) -> list[str]:
    """Command-line overrides that fix what the planner picked (the workers then plan nothing)."""
    out = []
    if "parallel.strategy" in auto:
        p = cfg.parallel
        out += [f"parallel.backend={p.backend}", f"parallel.strategy={p.strategy}", f"parallel.offload={p.offload}",
                f"parallel.activation_checkpointing={p.activation_checkpointing}",
                f"parallel.activation_offload={str(p.activation_offload).lower()}",
                f"parallel.shard_frozen={str(p.shard_frozen).lower()}",
                f"parallel.checkpoint_in_compile={str(p.checkpoint_in_compile).lower()}",
                # null where the pick runs without them: the workers load the config's own values first
                f"parallel.activation_memory_budget={_or_null(p.activation_memory_budget)}",
                f"parallel.checkpoint_blocks={_or_null(p.checkpoint_blocks)}",
                f"parallel.tiled_mlp={_or_null(p.tiled_mlp)}"]
        if cfg.peft.offload_head is True:  # taken by the search (its auto), or the config's
            out.append("peft.offload_head=true")
    if "train.micro_batch_size" in auto:
        out.append(f"train.micro_batch_size={cfg.train.micro_batch_size}")
    return out


def _or_null(value: float | None) -> str:
    return "null" if value is None else f"{value:g}"


def write_plan(plan: Plan, path: Path) -> None:
    path.write_text(json.dumps(plan.to_json(), indent=2))


def predict_run(cfg: Any, hf_config: Any, hardware: Any, *, world: int, per_node: int) -> Candidate:
    """The prediction for the run as configured (no search): what OUTPUT_DIR/plan.json records."""
    from shardtune.plan.search import price

    targets = cfg.peft.target_modules if cfg.peft.target_modules != "auto" else None
    shape = model_shape(hf_config, targets, cfg.peft.r)
    capacity = hardware.memory_bytes * (1 - SAFETY_MARGIN)
    setting = setting_from_config(cfg, world, per_node, liger=liger_applies(cfg, hf_config, hardware))
    return price(shape, setting, hardware, capacity, None)


def run_record(cfg: Any, hf_config: Any, hardware: Any, *, world: int, per_node: int) -> dict[str, Any]:
    """plan.json of a run: the hardware it was priced for and the prediction (`chosen`)."""
    c = predict_run(cfg, hf_config, hardware, world=world, per_node=per_node)
    return {"hardware": {"name": hardware.name, "memory_gib": round(hardware.memory_bytes / GIB, 2)},
            "world": world, "per_node": per_node, "chosen": c.to_json()}


def compare(predicted: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's `plan`: predicted against measured peak memory and tokens/s, errors as fractions."""
    from shardtune.plan.report import measured_from

    measured = measured_from(history)
    chosen = predicted["chosen"]
    out: dict[str, Any] = {"hardware": predicted["hardware"]["name"],
                           "predicted": {"peak_allocated_gib": chosen["memory_gib"]["allocated"],
                                         "peak_reserved_gib": chosen["memory_gib"]["reserved"],
                                         "tokens_per_sec_per_gpu": chosen["tokens_per_sec_per_gpu"]},
                           "measured": measured}
    if measured:
        out["error"] = {k: (out["predicted"][k] - v) / v for k, v in measured.items() if v}
    return out
