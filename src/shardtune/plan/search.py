"""The search: every way to run a config on the given machines, priced, filtered by what fits, ranked
by predicted tokens/s."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardtune.parallel import BACKENDS
from shardtune.plan.memory import GIB, Memory, gpu_memory
from shardtune.plan.setting import Setting
from shardtune.plan.shape import ModelShape
from shardtune.plan.speed import StepTime, step_time

# Share of the device's memory kept free beyond the prediction (the model's error, other processes).
SAFETY_MARGIN = 0.05
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# parallel.activation_memory_budget values priced beside none / selective / full for compiled blocks: 8B LoRA float8
# on one H100 kept 0.37 / 0.52 of none's extra activations for +10% / +14% over full checkpointing (calls 89, 91);
# lower budgets bought little (0.1: +0.7%).
SEARCHED_BUDGETS = (0.3, 0.5)
# parallel.tiled_mlp's tokens a tile where the search prices the MLPs in tiles: 1.3 GiB of one tile's backward on the
# 8B shape (memory.TILE_TRANSIENT), GEMMs of 8,192 rows (DeepSpeed's TiledMLP takes tiles of the hidden size, 4,096).
SEARCHED_TILE = 8192
CONFIG_KEYS = {"backend": "parallel.backend", "strategy": "parallel.strategy", "offload": "parallel.offload",
               "activation_checkpointing": "parallel.activation_checkpointing",
               "memory_budget": "parallel.activation_memory_budget",
               "activation_offload": "parallel.activation_offload", "shard_frozen": "parallel.shard_frozen",
               "offload_embedding": "peft.offload_embedding", "offload_head": "peft.offload_head",
               "micro_batch_size": "train.micro_batch_size",
               "checkpoint_in_compile": "parallel.checkpoint_in_compile",
               "checkpoint_blocks": "parallel.checkpoint_blocks", "tiled_mlp": "parallel.tiled_mlp"}


@dataclass
class Candidate:
    setting: Setting
    memory: Memory
    time: StepTime
    fits: bool
    fits_host: bool = True

    @property
    def usable(self) -> bool:
        return self.fits and self.fits_host

    def to_json(self) -> dict[str, Any]:
        mem = {"total": self.memory.total / GIB, "allocated": self.memory.allocated / GIB,
               "reserved": self.memory.reserved / GIB, **{k: v / GIB for k, v in self.memory.terms.items()}}
        return {**self.setting.knobs(), "memory_gib": _round(mem), "peak_phase": self.memory.phase,
                "host_memory_gib": round(self.memory.host_total / GIB, 2),
                "host_memory_terms_gib": _round({k: v / GIB for k, v in self.memory.host.items()}),
                "tokens_per_sec_per_gpu": round(self.time.tokens_per_sec_per_gpu, 1),
                "step_time_s": round(self.time.seconds, 4), "mfu": round(self.time.mfu, 4),
                "time_terms_s": _round(self.time.terms, 4),
                "comm_bytes_per_step": {k: int(v) for k, v in self.time.comm_bytes.items()},
                "fits": self.fits, "fits_host": self.fits_host}


def _round(d: dict[str, float], digits: int = 2) -> dict[str, float]:
    return {k: round(v, digits) for k, v in d.items()}


@dataclass
class Search:
    candidates: list[Candidate]
    configured: Candidate
    pick: Candidate | None
    capacity: float  # bytes usable per GPU after the safety margin
    host_capacity: float | None
    refused: dict[tuple[str, str, str, bool], str] = field(default_factory=dict)  # combination -> why not


def price(m: ModelShape, s: Setting, hw: Any, capacity: float, host_capacity: float | None) -> Candidate:
    mem = gpu_memory(m, s)
    return Candidate(s, mem, step_time(m, s, hw), fits=mem.total <= capacity,
                     fits_host=host_capacity is None or mem.host_total <= host_capacity)


def search(m: ModelShape, base: Setting, hw: Any, *, supported: Callable[[Setting], str | None],
           micro_batches: tuple[int, ...] | None = None, host_capacity: float | None = None) -> Search:
    """Price every backend x strategy x offload x checkpointing x activation offload (x micro-batch when
    `micro_batches` is given) variant of `base`; `supported(setting)` returns why a combination cannot run, or
    None."""
    capacity = hw.memory_bytes * (1 - SAFETY_MARGIN)
    why: dict[tuple[str, str, str, bool, str], str] = {}  # (backend, strategy, offload, moved, checkpointing)
    out: list[Candidate] = []
    for backend, (ac, budget), mb, moved in itertools.product(BACKENDS, checkpointing_options(base),
                                                              micro_batches or (base.micro_batch_size,),
                                                              (False, True)):
        declared = BACKENDS[backend].supports  # what the backend's own module says it runs
        for strategy, offload in itertools.product(declared["parallel.strategy"], declared["parallel.offload"]):
            if strategy == "hsdp" and base.nnodes == 1:
                continue  # on one node hsdp is zero3
            if moved and base.compile and ac == "none":
                # the offload of what compiled blocks keep without a checkpoint: asked only. Measured at 2,048 tokens
                # (8B LoRA, budget 0.3, calls 127-128: no faster than full checkpointing, planner within 7%), not
                # at the long sequences where the search would take it, moving 170-430 GiB a step over PCIe
                continue
            # parallel.checkpoint_blocks: the config's, under full checkpointing (what it runs with)
            blocks = base.checkpoint_blocks if ac == "full" else None
            s = base.replace(backend=backend, strategy=strategy, offload=offload, activation_checkpointing=ac,
                             checkpoint_blocks=blocks, memory_budget=budget, activation_offload=moved,
                             micro_batch_size=mb,
                             nvme=base.nvme and offload != "none")
            key = (backend, strategy, offload, moved, ac, budget)
            if key not in why:
                why[key] = supported(s) or ""
            if why[key]:
                continue
            out.append(price(m, s, hw, capacity, host_capacity))
            if out[-1].usable and (fewer := _fewest_checkpointed(m, s, hw, capacity, host_capacity)):
                out.append(fewer)
            if _frozen_is_a_trade(s):  # the frozen base whole on every GPU instead, priced beside it
                out.append(price(m, s.replace(shard_frozen=not s.shard_frozen), hw, capacity, host_capacity))
            if _embedding_is_a_trade(m, s):  # the input embedding on the host instead (or back), beside it
                out.append(price(m, s.replace(offload_embedding=not s.offload_embedding), hw, capacity,
                                 host_capacity))
            if _head_is_a_trade(m, s):  # the LM head on the host too, beside it
                out.append(price(m, s.replace(offload_head=True), hw, capacity, host_capacity))
            if _placement_is_a_trade(s, supported):  # the checkpoint around the compiled blocks, beside it
                out.append(price(m, s.replace(checkpoint_in_compile=False), hw, capacity, host_capacity))
            if _tiles_are_a_trade(s, supported):  # the MLPs in tiles, beside it (long sequences)
                out.append(price(m, s.replace(tiled_mlp=SEARCHED_TILE), hw, capacity, host_capacity))
    configured = price(m, base, hw, capacity, host_capacity)
    usable = [c for c in out if c.usable]
    pick = max(usable, key=lambda c: (c.time.tokens_per_sec_per_gpu, -c.memory.total)) if usable else None
    out.sort(key=lambda c: (not c.usable, -c.time.tokens_per_sec_per_gpu))
    ran = {k[:4] for k, v in why.items() if not v}
    refused = {k[:4]: v for k, v in why.items() if v and k[:4] not in ran}  # refused whatever the checkpointing
    return Search(out, configured, pick, capacity, host_capacity, refused)


def checkpointing_options(base: Setting) -> list[tuple[str, float | None]]:
    """(activation_checkpointing, activation_memory_budget) pairs to price: none, selective and full with the
    config's budget (it applies to none only), and with compiled blocks none under each of SEARCHED_BUDGETS. With
    parallel.tiled_mlp, none and full only (the config refuses it beside selective or a budget)."""
    if base.tiled_mlp is not None:
        return [("none", None), ("full", None)]
    options = [(ac, base.memory_budget) for ac in ("none", "selective", "full")]
    if base.compile:
        options += [("none", b) for b in SEARCHED_BUDGETS if b != base.memory_budget]
    return options


def _fewest_checkpointed(m: ModelShape, s: Setting, hw: Any, capacity: float,
                         host_capacity: float | None) -> Candidate | None:
    """Full checkpointing of the first N blocks only (parallel.checkpoint_blocks), the smallest N that fits where all
    L fit and the config names no N: each block left out keeps its activations and skips its recompute, faster and
    larger (8B LoRA, two of 32 blocks out: +1.4% / +1.7% at 0.12 GiB more, calls 135-136). None where only all L fit
    (N = 0 is no checkpointing, priced on its own). Eager blocks without the activation offload only (a config's N
    runs with both, priced): the compiled blocks left out of the checkpoint are priced from 8B LoRA at 4,096 tokens
    only (their backward's COMPILED_BACKWARD, calls 134-142), and opened to them the search picks N at
    65,536-98,304 tokens, never measured; compiled blocks have the memory budgets (SEARCHED_BUDGETS) for the same
    trade (priced side by side, within 0.1%: 8B LoRA float8 on 32 GiB, the first 11 blocks against budget 0.5)."""
    if s.activation_checkpointing != "full" or s.activation_offload or s.checkpoint_blocks is not None or s.compile:
        return None
    low, high, best = 1, m.layers, None  # all `high` blocks checkpointed fit; memory grows as N falls
    while low < high:
        n = (low + high) // 2
        candidate = price(m, s.replace(checkpoint_blocks=n), hw, capacity, host_capacity)
        if candidate.usable:
            high, best = n, candidate
        else:
            low = n + 1
    return best


def _frozen_is_a_trade(s: Setting) -> bool:
    """parallel.shard_frozen changes this setting and there is more than one GPU to shard over (on one, `auto`
    keeps the base whole: less memory and faster, measured)."""
    return (s.world > 1 and s.peft != "none" and s.rules.keeps_frozen_local(s)
            and s.frozen_bytes == s.compute_bytes)


def _embedding_is_a_trade(m: ModelShape, s: Setting) -> bool:
    """peft.offload_embedding changes this setting: PEFT on the one-GPU direct path, an untied embedding."""
    return s.replace(offload_embedding=True).embedding_on_host(m)


def _head_is_a_trade(m: ModelShape, s: Setting) -> bool:
    """peft.offload_head could run here and is off: PEFT on the one-GPU direct path, an untied head. Priced beside
    (1 GB less on the 8B shape for 2.1% of the step, measured), taken only where the pick lets it (its auto)."""
    return not s.offload_head and s.replace(offload_head=True).head_on_host(m)


def _tiles_are_a_trade(s: Setting, supported: Callable[[Setting], str | None]) -> bool:
    """parallel.tiled_mlp could split this micro-batch's MLPs into SEARCHED_TILE-token tiles (the config sets none,
    full checkpointing, the checkpoint not forced inside compiled blocks, and the backend runs it): priced beside,
    one more MLP forward a step for the MLP's intermediates off the recomputed block's peak, so the pick (fastest
    that fits) takes it only where nothing untiled fits. Under full checkpointing only, what it is for (without a
    checkpoint the tiles run too, as a config asks; the search does not offer them there). On one H100 the pick
    ran 327,680 tokens of 8B QLoRA at 51.2 GiB (call 147)."""
    if s.tiled_mlp is not None or s.tokens <= SEARCHED_TILE or s.activation_checkpointing != "full":
        return False
    if s.checkpoint_in_compile is True:
        return False
    return supported(s.replace(tiled_mlp=SEARCHED_TILE)) is None


def _placement_is_a_trade(s: Setting, supported: Callable[[Setting], str | None]) -> bool:
    """parallel.checkpoint_in_compile's auto puts full checkpointing inside the compiled blocks here (no activation
    offload): faster (+8.5% on 8B LoRA / QLoRA at 4,096 tokens), but its backward holds 3.5 x p x f bytes per token
    more (memory.INSIDE_RECOMPUTE: 6.25 GiB at 65,536 tokens of the 8B), so around is priced beside it where it
    runs (CUDA graphs rule it out): at long sequences it fits where inside does not, faster than moving the saved
    activations to the host."""
    return (s.checkpoint_in_compile == "auto" and s.activation_checkpointing == "full" and s.checkpoint_traced
            and not supported(s.replace(checkpoint_in_compile=False)))


def changes(a: Setting, b: Setting) -> dict[str, Any]:
    """Knobs of `b` that differ from `a`, as config keys. The input embedding as the config asks for it (auto or
    true: the host where that runs), not where it lands: off the direct path auto keeps it on the GPU by itself."""
    ka, kb = a.knobs(), b.knobs()
    ka["offload_embedding"], kb["offload_embedding"] = a.offload_embedding, b.offload_embedding
    return {CONFIG_KEYS[k]: kb[k] for k in ka if ka[k] != kb[k]}


def smallest_fixes(result: Search, limit: int = 2) -> list[tuple[dict[str, Any], Candidate]]:
    """Candidates that fit, fewest changed knobs first, then fastest; one per distinct set of changes, and none that
    holds a fix already named (its other changes are not needed)."""
    base = result.configured.setting
    options = []
    for c in result.candidates:
        if not c.usable:
            continue
        diff = changes(base, c.setting)
        if diff:
            options.append((len(diff), -c.time.tokens_per_sec_per_gpu, diff, c))
    options.sort(key=lambda o: (o[0], o[1]))
    seen, fixes = set(), []
    for _, _, diff, c in options:
        key = tuple(sorted(diff))
        if key in seen or any(named.items() <= diff.items() for named, _ in fixes):
            continue
        seen.add(key)
        fixes.append((diff, c))
        if len(fixes) == limit:
            break
    return fixes
