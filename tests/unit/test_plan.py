"""The planner: memory terms against hand-computed values and the ZeRO paper, monotonicity, the activation
formula against autograd's own saved tensors, the search, refusals, and bad input (no processes, no GPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import block_saved_bytes

from shardtune.cli import main
from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.models.presets import preset_config
from shardtune.plan import make_plan, refusal, resolve_auto, resolve_hardware
from shardtune.plan.hardware import lookup
from shardtune.plan.memory import (
    FRAGMENTATION,
    GIB,
    NF4_BYTES,
    RECOMPUTE_FRAGMENTATION,
    activation_bytes_per_token_layer,
    activations,
    budget_kept_share,
    gpu_memory,
    logits_bytes,
    model_states,
    selective_bytes_per_token_layer,
)
from shardtune.plan.setting import Setting
from shardtune.plan.shape import ModelShape, model_shape
from shardtune.plan.speed import attention_flops_per_token, comm_bytes, step_time, train_flops_per_token

H200 = lookup("h200")


@pytest.fixture(scope="module")
def one_b() -> ModelShape:
    return model_shape(preset_config("llama-3.2-1b"))


@pytest.fixture(scope="module")
def eight_b() -> ModelShape:
    return model_shape(preset_config("llama-3-8b"))


def test_shape_counts_match_the_published_sizes(one_b: ModelShape, eight_b: ModelShape) -> None:
    assert one_b.params == 1_235_814_400 and eight_b.params == 8_030_261_248
    assert one_b.head_params == 0 and eight_b.head_params == 128256 * 4096  # 1B ties its head
    assert (one_b.hidden, one_b.ffn, one_b.kv_dim, one_b.layers) == (2048, 8192, 512, 16)
    # LoRA r=16 on the 7 projections of a Llama-3-8B block: r * (in + out) summed, times 32 blocks.
    per_block = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 2 + (14336 + 4096))
    assert eight_b.lora_params == 32 * per_block
    assert eight_b.target_params == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)


def _paper_shape(params: int) -> ModelShape:
    return ModelShape("llama", params, 1, params, 0, 0, 1024, 4096, 8, 1024, 32000, 0, 0)


@pytest.mark.parametrize(("strategy", "gb"), [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_model_states(strategy: str, gb: float) -> None:
    """ZeRO (Rajbhandari et al. 2020), figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12):
    120 / 31.4 / 16.6 / 1.9 GB per GPU for DDP and stages 1 / 2 / 3."""
    s = Setting(backend="deepspeed", strategy=strategy, precision="fp16", world=64, per_node=8)
    states = model_states(_paper_shape(7_500_000_000), s)
    held = states["parameters"] + states["master_weights"] + states["gradients"] + states["optimizer"]
    assert held / 1e9 == pytest.approx(gb, abs=0.05)


def test_fsdp2_model_states_are_16_bytes_per_parameter_over_the_shards(one_b: ModelShape) -> None:
    for world in (1, 2, 8, 64):
        states = model_states(one_b, Setting(strategy="zero3", world=world, per_node=min(world, 8)))
        assert sum(states.values()) == pytest.approx(16 * one_b.params / world)
    lora = model_states(one_b, Setting(strategy="zero3", peft="lora", world=4, per_node=4))
    # Frozen base in bf16 (2 bytes), adapters with fp32 masters, grads and two moments; all sharded.
    assert lora["parameters"] == pytest.approx((2 * one_b.params + 4 * one_b.lora_params) / 4)
    assert lora["optimizer"] == pytest.approx(8 * one_b.lora_params / 4)
    qlora = model_states(one_b, Setting(strategy="zero3", peft="qlora", world=1))
    frozen = one_b.target_params * NF4_BYTES + (one_b.params - one_b.target_params) * 2
    assert qlora["parameters"] == pytest.approx(frozen + 4 * one_b.lora_params)
    eight = model_states(one_b, Setting(strategy="zero2", optim="adamw8bit"))
    assert eight["optimizer"] / one_b.params == pytest.approx(2.03, abs=0.01)


def test_activation_terms_by_hand(one_b: ModelShape) -> None:
    s = Setting(micro_batch_size=4, seq_len=2048)
    # 8h + 6ph + 2pk + 4pf + 4a with p = 2: 16384 + 24576 + 2048 + 65536 + 128
    assert activation_bytes_per_token_layer(one_b, s) == 108_672
    assert activations(one_b, s) == (16 * 108_672 * 8192, 0.0)
    saved, recompute = activations(one_b, replace(s, activation_checkpointing="full"))
    assert saved == 16 * 2 * 2048 * 8192 and recompute == 108_672 * 8192
    assert logits_bytes(one_b, s) == (2 * 2 + 8) * 128256 * 8192
    compiled = activation_bytes_per_token_layer(one_b, replace(s, compile=True))
    assert compiled == 108_672 - 8 * 2048 - 2 * 8192


def test_the_fused_loss_replaces_the_logits(one_b: ModelShape) -> None:
    """model.liger's fused linear + cross-entropy: chunks of next_pow2(ceil(8192 / ceil(128256 / 2048))) = 256
    rows of bf16 logits (overwritten by their gradient), the input's gradient and the tied head's gradient, not
    11.7 GiB of logits. Measured on one H200 (bench/RESULTS.md 2026-12-02, 1B full fine-tuning, zero2 + compile,
    micro-batch 4, the head's gradient summed in fp32): peak 37.3 GiB without, 27.1 with: 10.2 GiB less; the
    planner's peak must drop by that within 10%."""
    from shardtune.plan.memory import fused_loss_bytes

    s = Setting(strategy="zero2", compile=True, micro_batch_size=4, seq_len=2048, fused_loss=True, liger_accum="fp32")
    head, held = 128256 * 2048, 8192 * 2048 * 2
    assert fused_loss_bytes(one_b, s) == held + 6 * head  # the fp32 sum and its bf16 cast, after the last chunk
    assert logits_bytes(one_b, s) == fused_loss_bytes(one_b, s)
    drop = gpu_memory(one_b, replace(s, fused_loss=False)).allocated - gpu_memory(one_b, s).allocated
    assert drop / 2**30 == pytest.approx(10.2, rel=0.10)
    # DeepSpeed takes the fused loss on every stage (ZeRO-3 gathers the head for it); a frozen LM head (LoRA) has
    # no gradient to keep.
    for strategy in ("zero2", "zero3"):
        assert logits_bytes(one_b, replace(s, backend="deepspeed", strategy=strategy)) == fused_loss_bytes(one_b, s)
    assert logits_bytes(one_b, replace(s, fused_loss=False)) == (2 * 2 + 8) * 128256 * 8192
    assert fused_loss_bytes(one_b, replace(s, peft="lora")) == 256 * 128256 * 2 + held
    # model.liger_chunk: 1,024-token chunks hold four times the logits of Liger's own 256 (with the bf16 sum, the
    # default, a chunk's logits are alive beside it).
    weight = replace(s, liger_accum="weight")
    assert fused_loss_bytes(one_b, weight) == 256 * 128256 * 2 + held + 2 * head
    assert fused_loss_bytes(one_b, replace(weight, liger_chunk=1024)) == 1024 * 128256 * 2 + held + 2 * head


def test_the_head_gradient_summed_in_the_weights_dtype_holds_less_at_the_peak(one_b: ModelShape) -> None:
    """model.liger_accum: weight (the default) sums the LM head's gradient over the fused loss's chunks in the bf16
    weight's dtype (Liger's accum_dtype=None, what HF Trainer + Liger runs); fp32 sums it in an fp32 accumulator
    that Liger casts to bf16 after the last chunk, both alive: 6 bytes a head weight against 2 + a chunk's logits.
    Measured (one H100, 1B at table 1's settings, 1024-token chunks, calls 98 and 100): 27.069 vs 26.335 GiB peak,
    0.734 GiB; 1.6-2.2% faster (priced: the accumulator's bytes each chunk's addmm reads and writes, halved, at the
    H100's HBM rate: 2.5 ms of a 0.137 s step). DDP's fp32
    parameters, fp32 training and a frozen head are unchanged by it."""
    from shardtune.plan.memory import fused_loss_bytes
    from shardtune.plan.speed import fused_chunk_seconds

    s = Setting(strategy="zero2", compile=True, micro_batch_size=4, seq_len=2048, fused_loss=True, liger_chunk=1024,
                liger_accum="fp32")
    low = replace(s, liger_accum="weight")
    head = 128256 * 2048
    saved = fused_loss_bytes(one_b, s) - fused_loss_bytes(one_b, low)
    assert saved == 4 * head - 1024 * 128256 * 2
    assert saved / 2**30 == pytest.approx(27.069 - 26.335, rel=0.02)
    for other in (replace(low, strategy="ddp"), replace(low, precision="fp32"), replace(low, peft="lora")):
        assert fused_loss_bytes(one_b, other) == fused_loss_bytes(one_b, replace(other, liger_accum="fp32"))
    h100 = lookup("h100")
    faster = fused_chunk_seconds(one_b, s, h100) - fused_chunk_seconds(one_b, low, h100)
    assert faster == pytest.approx(8 * 2 * 2 * head / h100.hbm_bytes_per_s)  # 8 chunks, 2 bytes less each way
    assert faster * 1000 == pytest.approx(2.55, rel=0.1)  # ms a step: 2.2 and 2.9 measured (calls 98, 100)
    assert step_time(one_b, low, h100).seconds < step_time(one_b, s, h100).seconds


def test_a_memory_budget_is_priced_between_none_and_full_inside_compile(one_b: ModelShape,
                                                                        eight_b: ModelShape) -> None:
    """parallel.activation_memory_budget: the saved activations full checkpointing keeps plus the share of the rest
    the partitioner was measured to keep at that budget (memory.BUDGET_KEPT: 0.52 at 0.5), and the share of the
    traced recompute's FLOPs and backward memory it was measured to pay (setting.BUDGET_RECOMPUTE: 0.36 at 0.5, less
    than the budget's complement); only under compile without checkpointing, and the planner's search then leaves
    the checkpointing alone."""
    from shardtune.plan import describe, free_knobs

    base = Setting(micro_batch_size=4, seq_len=2048, compile=True)
    for m in (one_b, eight_b):
        none, full = base, replace(base, activation_checkpointing="full")
        low, half, high = (replace(base, memory_budget=b) for b in (0.0, 0.5, 1.0))
        assert activations(m, high) == activations(m, none) and activations(m, low)[0] == activations(m, full)[0]
        assert activations(m, half)[0] == pytest.approx(activations(m, low)[0] + 0.52 * (activations(m, high)[0]
                                                                                      - activations(m, low)[0]))
        assert budget_kept_share(0.3) == pytest.approx(0.37) and budget_kept_share(0.2) == pytest.approx(0.2775)
        assert train_flops_per_token(m, low) == train_flops_per_token(m, full)  # the traced recompute's
        assert train_flops_per_token(m, high) == train_flops_per_token(m, none)
        assert half.budget_recompute == pytest.approx(0.36) and replace(base, memory_budget=0.2).budget_recompute \
            == pytest.approx(0.75)
        assert train_flops_per_token(m, half) == pytest.approx(
            train_flops_per_token(m, none) + 0.36 * (train_flops_per_token(m, full) - train_flops_per_token(m, none)))
        assert attention_flops_per_token(m, low) == attention_flops_per_token(m, full)
        h200 = lookup("h200")
        assert (step_time(m, none, h200).seconds < step_time(m, half, h200).seconds
                < step_time(m, low, h200).seconds)
        assert gpu_memory(m, high).total == gpu_memory(m, none).total
        assert gpu_memory(m, low).total == pytest.approx(gpu_memory(m, full).total, rel=0.01)
        # a recompute inside the compiled backward reserves no more than no recompute (1B at 0.5 on an H100, call 93:
        # 1.018 x allocated), not the eager recompute's extra share (RECOMPUTE_FRAGMENTATION)
        eager_full = replace(full, compile=False)
        for s in (half, eager_full):
            mem = gpu_memory(m, s)
            assert mem.reserved / mem.allocated == pytest.approx(
                1 + FRAGMENTATION + (RECOMPUTE_FRAGMENTATION if s is eager_full else 0.0))
    # no compile, or checkpointing set: no budget applies (config refuses the pair; a searched setting ignores it)
    for other in (replace(base, compile=False, memory_budget=0.5),
                  replace(base, memory_budget=0.5, activation_checkpointing="full")):
        assert other.budget_recompute == 0.0
    assert "activation memory budget 0.5" in describe(replace(base, memory_budget=0.5))
    cfg = _cfg("model.preset=llama-3.2-1b", "parallel.strategy=auto", "parallel.compile=true",
               "parallel.activation_memory_budget=0.5")
    assert "activation_checkpointing" not in free_knobs(cfg) and "strategy" in free_knobs(cfg)
    resolved, plan = resolve_auto(cfg, preset_config("llama-3.2-1b"), H200, world=1, per_node=1)
    assert resolved.parallel.activation_checkpointing == "none"
    assert resolved.parallel.activation_memory_budget == 0.5
    assert plan.chosen().setting.budget_recompute == pytest.approx(0.36)
    assert "activation_checkpointing" in free_knobs(_cfg("parallel.strategy=auto", "parallel.compile=true"))


def test_lora_blocks_in_float8_that_keep_their_activations_save_the_adapters_bf16_inputs(eight_b: ModelShape) -> None:
    """Compiled float8 blocks save float8 copies of the matmul inputs (FLOAT8_ACTIVATIONS), except LoRA's that keep
    all they save: the adapters read the bf16 inputs (call 91: 1.116 x the bf16 count). The block one backward
    recomputes under full checkpointing stays the float8 count (measured there: 0.18 GiB under bf16)."""
    lora = Setting(micro_batch_size=2, seq_len=2048, compile=True, peft="lora")
    f8 = replace(lora, float8="tensorwise")
    assert activations(eight_b, f8)[0] == pytest.approx(1.116 * activations(eight_b, lora)[0])
    full, full_f8 = (replace(x, activation_checkpointing="full") for x in (lora, f8))
    assert activations(eight_b, full_f8)[1] == pytest.approx(0.676 * activations(eight_b, full)[1])
    whole = replace(f8, peft="none")  # full fine-tuning: the float8 copies replace the bf16 inputs
    bf16 = replace(whole, float8="false")
    assert activations(eight_b, whole)[0] == pytest.approx(0.676 * activations(eight_b, bf16)[0])


def test_the_search_prices_memory_budgets_and_picks_one_where_none_does_not_fit() -> None:
    """With compiled blocks and the checkpointing left to the planner, budgets 0.3 and 0.5 are priced beside none,
    selective and full; on a GPU where none does not fit and 0.5 does, the pick is 0.5 (faster than full and
    selective), and the resolved config and the workers' overrides carry it."""
    from shardtune.plan import auto_overrides

    given = ["model.preset=llama-3-8b", "peft.method=lora", "train.float8=tensorwise", "parallel.compile=true",
             "parallel.strategy=auto", "train.micro_batch_size=2"]
    cfg = _cfg(*given)
    small = replace(lookup("h100"), memory_bytes=32 * GIB)
    resolved, plan = resolve_auto(cfg, preset_config("llama-3-8b"), small, world=1, per_node=1)
    priced = {(c.setting.activation_checkpointing, c.setting.memory_budget) for c in plan.result.candidates}
    assert priced >= {("none", None), ("selective", None), ("full", None), ("none", 0.3), ("none", 0.5)}
    chosen = plan.chosen().setting
    assert (chosen.activation_checkpointing, chosen.memory_budget) == ("none", 0.5), chosen
    assert resolved.parallel.activation_checkpointing == "none" and resolved.parallel.activation_memory_budget == 0.5
    assert "parallel.activation_memory_budget=0.5" in auto_overrides(resolved, plan.auto)
    worker = _cfg(*given, *auto_overrides(resolved, plan.auto))  # what the launcher's workers load
    assert worker.parallel.activation_checkpointing == "none" and worker.parallel.activation_memory_budget == 0.5
    assert worker.parallel.strategy == chosen.strategy
    on_h100 = resolve_auto(cfg, preset_config("llama-3-8b"), lookup("h100"), world=1, per_node=1)[0]
    assert on_h100.parallel.activation_memory_budget is None  # none fits there, and is faster
    eager = resolve_auto(_cfg("model.preset=llama-3-8b", "peft.method=lora", "parallel.strategy=auto",
                              "train.micro_batch_size=2"), preset_config("llama-3-8b"), small, world=1, per_node=1)[1]
    assert all(c.setting.memory_budget is None for c in eager.result.candidates)  # a budget needs compile


def test_the_input_embedding_goes_to_the_host_by_default_and_the_search_keeps_it() -> None:
    """peft.offload_embedding: auto (the default) puts LoRA / QLoRA's frozen, untied input embedding on the host on
    the one-GPU direct path (1 GB less on the 8B shape, under 1% slower measured), and `parallel.strategy: auto`
    keeps that rule: each direct setting is priced with the embedding on the host and on the GPU (the table shows
    both), the pick keeps the config's. Set false, it stays on the GPU, and a config that then does not fit is
    told the flag is a fix. A tied embedding (the 1B) or full fine-tuning: never on the host."""
    from shardtune.plan.report import table

    given = ["model.preset=llama-3-8b", "peft.method=lora", "parallel.compile=true", "parallel.strategy=auto",
             "train.micro_batch_size=2"]
    cfg, hf = _cfg(*given), preset_config("llama-3-8b")
    assert cfg.peft.offload_embedding == "auto"
    resolved, plan = resolve_auto(cfg, hf, lookup("h100"), world=1, per_node=1)
    assert plan.pick is not None and plan.pick.setting.embedding_on_host(plan.shape)
    assert resolved.peft.offload_embedding == "auto"  # the workers take it from the same rule
    assert "input embedding in host memory" in plan.reason() and any("+e" in line for line in table(plan))
    priced = {c.setting.offload_embedding for c in plan.result.candidates if c.setting.one_gpu_direct}
    assert priced == {False, True}
    on_gpu = make_plan(_cfg(*given, "peft.offload_embedding=false"), hf, lookup("h100"), world=1, per_node=1)
    assert on_gpu.pick is not None and not on_gpu.pick.setting.offload_embedding
    if plan.pick.setting.replace(offload_embedding=False) == on_gpu.pick.setting:  # the table, 1 GB, and no more
        assert on_gpu.pick.memory.allocated - plan.pick.memory.allocated == pytest.approx(128256 * 4096 * 2)
    # set false on a GPU where only the host embedding fits: the refusal names the flag
    need = min(c.memory.total for c in plan.result.candidates
               if c.setting.one_gpu_direct and not c.setting.offload_embedding)
    tight = replace(lookup("h100"), memory_bytes=int((need - 0.5 * GIB) / 0.95))
    fixed = make_plan(_cfg(*given[:3], "parallel.strategy=zero2", "train.micro_batch_size=2",
                           "parallel.activation_checkpointing=full", "peft.offload_embedding=false"),
                      hf, tight, world=1, per_node=1)
    line = refusal(fixed)
    assert line and "peft.offload_embedding=true" in line, line
    # a tied embedding (the 1B) or full fine-tuning: never priced on the host
    for other in (_cfg("model.preset=llama-3.2-1b", "peft.method=lora", "parallel.strategy=auto"),
                  _cfg("model.preset=llama-3-8b", "parallel.strategy=auto")):
        plan = make_plan(other, preset_config(other.model.preset), lookup("h100"), world=1, per_node=1)
        assert not any(c.setting.embedding_on_host(plan.shape) for c in plan.result.candidates)


def test_a_fix_for_a_budget_that_does_not_fit_unsets_it() -> None:
    # checkpointing beside a budget is refused at load: the fix that checkpoints says to unset the budget (null)
    given = ["model.preset=llama-3-8b", "peft.method=lora", "train.float8=tensorwise", "parallel.compile=true",
             "parallel.activation_memory_budget=0.5", "parallel.strategy=zero2", "train.micro_batch_size=2"]
    small = replace(lookup("h100"), memory_bytes=22 * GIB)
    plan = make_plan(_cfg(*given), preset_config("llama-3-8b"), small, world=1, per_node=1)
    line = refusal(plan)
    assert line and "parallel.activation_checkpointing=full parallel.activation_memory_budget=null fits" in line, line
    fix = line.split(": ", 1)[1].split(" fits")[0].split()
    fixed = _cfg(*given, *fix)
    assert fixed.parallel.activation_checkpointing == "full" and fixed.parallel.activation_memory_budget is None


def test_selective_checkpointing_sits_between_none_and_full(one_b: ModelShape, eight_b: ModelShape) -> None:
    """parallel/prepare.py keeps the block input, the q, v, gate and down outputs and the attention output and
    log-sum-exp: p(4h + k + f) + 4a bytes per token and block; it recomputes the k, o and up projections."""
    from shardtune.plan import describe
    from shardtune.plan.memory import selective_bytes_per_token_layer
    from shardtune.plan.speed import SELECTIVE_LAYER_S

    s = Setting(micro_batch_size=4, seq_len=2048, activation_checkpointing="selective")
    assert selective_bytes_per_token_layer(one_b, s) == 2 * (4 * 2048 + 512 + 8192) + 4 * 32
    for m in (one_b, eight_b):
        none, sel, full = (replace(s, activation_checkpointing=a) for a in ("none", "selective", "full"))
        assert sum(activations(m, full)) < sum(activations(m, sel)) < sum(activations(m, none))
        assert train_flops_per_token(m, none) < train_flops_per_token(m, sel) < train_flops_per_token(m, full)
        # In time only where a micro-batch amortises the policy's fixed cost per layer (speed.SELECTIVE_LAYER_S,
        # measured at 4,096-32,768 tokens): 32,768 tokens here.
        h200, big = lookup("h200"), {a: replace(x, micro_batch_size=16) for a, x in (("n", none), ("s", sel),
                                                                                      ("f", full))}
        assert step_time(m, big["f"], h200).seconds > step_time(m, big["s"], h200).seconds > \
            step_time(m, big["n"], h200).seconds
        assert step_time(m, sel, h200).terms["overhead"] == pytest.approx(
            step_time(m, none, h200).terms["overhead"] + SELECTIVE_LAYER_S * m.layers)
    assert "checkpointing selective" in describe(s)


def test_the_plan_line_says_what_liger_puts_in() -> None:
    from shardtune.plan import describe

    assert describe(Setting(fused_loss=True, liger_kernels=True)).endswith(", liger kernels + fused loss")
    assert describe(Setting(fused_loss=True)).endswith(", liger fused loss")
    assert describe(Setting(backend="deepspeed", fused_loss=True, liger_kernels=True)).endswith(
        ", liger kernels + fused loss")  # ZeRO-3 too
    assert "liger" not in describe(Setting())


def test_the_plan_counts_the_fused_loss_only_where_it_runs() -> None:
    from conftest import ROOT

    from shardtune.models.build import load_hf_config
    from shardtune.plan import liger_applies
    from shardtune.plan.hardware import GPUS

    h200, cpu = GPUS["h200"], replace(GPUS["h200"], name="cpu")
    for value, on_gpu in (("true", True), ("loss", True), ("false", False)):
        cfg = load_config(str(ROOT / "examples" / "tiny.yaml"), [f"model.liger={value}"])
        hf = load_hf_config(cfg.model)
        assert liger_applies(cfg, hf, h200) is on_gpu
        assert liger_applies(cfg, hf, cpu) is False


@pytest.mark.parametrize("installed", [True, False])
def test_the_default_plan_takes_ligers_fused_loss_where_it_is_installed(monkeypatch, installed) -> None:
    """model.liger defaults to auto: a plain 1B config planned for an H200 is priced with Liger's fused loss (no
    logits held) where liger-kernel is installed, and with the whole logits where it is not."""
    from conftest import ROOT

    from shardtune.models import liger_rules
    from shardtune.models.build import load_hf_config
    from shardtune.plan.hardware import GPUS

    monkeypatch.setattr(liger_rules, "liger_installed", lambda: installed)
    cfg = load_config(str(ROOT / "examples" / "llama-1b.yaml"), ["model.liger_chunk=0"])
    assert cfg.model.liger == "auto"
    plan = make_plan(cfg, load_hf_config(cfg.model), GPUS["h200"], world=1, per_node=1)
    setting, memory = plan.configured.setting, plan.configured.memory
    assert setting.fused_loss is installed and setting.liger_kernels is False  # compiled: the loss only
    logits = 4 * 2048 * 128256 * 2  # the micro-batch's bf16 logits
    assert (memory.terms.get("logits", 0.0) >= logits) is not installed


def test_activation_formula_matches_autograds_saved_tensors() -> None:
    """Cross-check against PyTorch itself: the bytes autograd saves in one real decoder block (bf16, sdpa, on
    CPU), parameters and the cos/sin tables shared by every layer left out."""
    from transformers import AutoModelForCausalLM

    cfg = preset_config("tiny-llama")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    batch, seq = 2, 64
    measured = block_saved_bytes(model, batch, seq) / (batch * seq)
    predicted = activation_bytes_per_token_layer(model_shape(cfg), Setting(micro_batch_size=batch, seq_len=seq))
    assert measured == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize("compiled", [True, False])
def test_compiled_qlora_without_checkpointing_keeps_its_dequantised_weights(compiled: bool) -> None:
    """Compiled QLoRA blocks without checkpointing save every weight dequantised in bf16 for backward (compile's
    partitioner keeps them rather than dequantise again: 13 GiB on the 8B shape); this bare model leaves out the first
    block's q / k / v (its input needs no gradient here; in a run prepare gives it one, so the planner counts them
    all); eager blocks keep the 4-bit weight only (NF4Linear). The planner counts them
    (memory.dequantised_kept) and prices one dequantisation a micro-batch there (speed.dequant_passes)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.peft.qlora import quantize_to_nf4
    from shardtune.plan.memory import dequantised_kept
    from shardtune.plan.speed import dequant_passes

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=targets)).to(torch.bfloat16)
    quantize_to_nf4(model, lambda n: n.endswith(".base_layer"))
    if compiled:  # Inductor's decompositions and partitioner without its code generation (the same 11 weights kept
        # under inductor itself, 50 s of C++ compiling on a CI machine)
        for layer in model.base_model.model.model.layers:
            layer.compile(backend="aot_eager_decomp_partition")
    shapes = {(256, 256), (128, 256), (688, 256), (256, 688)}  # q and o, k and v, gate and up, down
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if type(p).__name__ != "NF4Tensor"}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:  # 96 tokens, 320 words: only weights have these shapes
        weight_like = type(t).__name__ != "NF4Tensor" and tuple(t.shape) in shapes
        if weight_like and (ptr := t.untyped_storage().data_ptr()) not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(5))
    # torch's default budget: a run in this process under parallel.activation_memory_budget (prepare sets the
    # global) would have the partitioner dequantise again rather than keep the weights
    with torch._functorch.config.patch(activation_memory_budget=1.0), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    shape = model_shape(cfg, targets, lora_r=4)
    s = Setting(peft="qlora", compile=compiled, activation_checkpointing="none", micro_batch_size=2, seq_len=48)
    first_qkv = 2 * 256 * (256 + 2 * 128)  # bf16 bytes of the first block's q, k, v
    assert sum(kept.values()) == (shape.target_params * 2 - first_qkv if compiled else 0)
    assert dequantised_kept(shape, s) == (shape.target_params * 2 if compiled else 0)
    assert dequant_passes(shape, s) == (1.0 if compiled else 2.0)
    assert dequant_passes(shape, replace(s, activation_checkpointing="full")) == (2.0 if compiled else 3.0)
    if compiled:  # under a memory budget: dequantised again in backward up to 0.7 (graphs read on CPU), kept at 0.8
        for budget, kept in ((0.3, False), (0.5, False), (0.7, False), (0.8, True)):
            b = replace(s, memory_budget=budget)
            assert (dequantised_kept(shape, b) > 0, dequant_passes(shape, b)) == (kept, 1.0 if kept else 2.0), budget


@pytest.mark.parametrize("peft_method", ["none", "lora"])
def test_selective_formula_matches_what_the_policy_saves(peft_method: str) -> None:
    """The selective policy (parallel/prepare.py) run on a real block, with PEFT's LoRA layers on all seven
    projections or without: the bytes of the outputs it marks to save (each matmul's from its operands' shapes,
    the attention kernel's output and log-sum-exp), plus the block input the checkpoint keeps, per token."""
    from peft import LoraConfig, get_peft_model
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    from transformers import AutoModelForCausalLM

    from shardtune.parallel.prepare import SAVED_OPS, selective_policy

    cfg = preset_config("tiny-llama")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if peft_method == "lora":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets)).base_model.model
    block = model.model.layers[0]
    batch, seq = 2, 64
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = model.model.rotary_emb(x, pos)
    inner, saved = selective_policy({"forward": 0, "recompute": 0}), [0]

    def recording(ctx, func, *args, **kwargs):
        decision = inner(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            if func == torch.ops.aten.mm.default:
                saved[0] += args[0].shape[0] * args[1].shape[1] * 2
            elif func in SAVED_OPS:  # (b, heads, s, d) query: output of its size, fp32 log-sum-exp per head
                b, a, s_, d = args[0].shape
                saved[0] += b * a * s_ * (d * 2 + 4)
        return decision

    checkpoint(block, x, position_embeddings=(cos, sin), position_ids=pos, attention_mask=None, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(recording))
    measured = saved[0] / (batch * seq) + 2 * cfg.hidden_size  # + the block input the checkpoint keeps
    shape = model_shape(cfg, None if peft_method == "lora" else [], lora_r=4)
    predicted = selective_bytes_per_token_layer(shape, Setting(micro_batch_size=batch, seq_len=seq, peft=peft_method))
    lora_a = 3 * 4 * 2 if peft_method == "lora" else 0  # three r-wide A outputs, left out of the formula
    assert measured == pytest.approx(predicted + lora_a, rel=1e-6)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_more_gpus_never_raise_model_states_or_the_peak(one_b: ModelShape, strategy: str) -> None:
    last = None
    for world in (1, 2, 4, 8, 16, 32, 64):
        s = Setting(strategy=strategy, micro_batch_size=2, world=world, per_node=min(world, 8))
        now = (sum(model_states(one_b, s).values()), gpu_memory(one_b, s).allocated)
        if last is not None:
            assert now[0] <= last[0]
            assert now[1] <= last[1] + 4 * one_b.block_params  # the reduce-scatter buffer appears at world 2
        last = now


@pytest.mark.parametrize("peft", ["none", "lora", "qlora"])
def test_checkpointing_never_raises_activations_or_the_peak(eight_b: ModelShape, peft: str) -> None:
    for mb, seq in [(1, 512), (2, 2048), (8, 8192)]:
        off = Setting(strategy="zero3", peft=peft, micro_batch_size=mb, seq_len=seq)
        on = replace(off, activation_checkpointing="full")
        assert sum(activations(eight_b, on)) <= sum(activations(eight_b, off))
        assert gpu_memory(eight_b, on).allocated <= gpu_memory(eight_b, off).allocated


def test_terms_add_up_and_offload_moves_states_to_the_host(one_b: ModelShape) -> None:
    s = Setting(backend="deepspeed", strategy="zero3", micro_batch_size=4, world=8, per_node=8)
    mem = gpu_memory(one_b, s)
    assert sum(mem.terms.values()) == pytest.approx(mem.allocated)
    assert mem.total > mem.reserved > mem.allocated
    off = gpu_memory(one_b, replace(s, offload="optimizer"))
    assert "optimizer" not in off.terms and "master_weights" not in off.terms
    assert off.allocated < mem.allocated
    # The node holds its 8 ranks' partitions: fp32 masters, moments and gradients (16 bytes) + (p + 4) staging.
    assert off.host["offload"] == pytest.approx((16 + 6) * one_b.params)
    staged = gpu_memory(one_b, replace(s, async_checkpoint=True)).host["checkpoint_staging"]
    assert staged == pytest.approx(12 * one_b.params)  # one host copy of the node's share: all of it here


def test_flops_and_communication_per_strategy(one_b: ModelShape) -> None:
    s = Setting(seq_len=2048)
    assert train_flops_per_token(one_b, s) == 6 * one_b.params + 12 * 16 * 2048 * 2048
    ac = train_flops_per_token(one_b, replace(s, activation_checkpointing="full"))
    assert ac - train_flops_per_token(one_b, s) == 2 * 16 * one_b.block_params + 4 * 16 * 2048 * 2048
    lora = train_flops_per_token(one_b, replace(s, peft="lora"))
    assert lora == 4 * one_b.params + 6 * one_b.lora_params + 12 * 16 * 2048 * 2048
    # Flash/SDPA kernels run half of causal attention's counted FLOPs; eager multiplies the whole score matrix.
    assert attention_flops_per_token(one_b, s) == (12 * 16 * 2048 * 2048, 6 * 16 * 2048 * 2048)
    assert attention_flops_per_token(one_b, replace(s, attn="eager", activation_checkpointing="full")) == \
        (16 * 16 * 2048 * 2048,) * 2
    n = one_b.params
    for world in (2, 8):
        ring = (world - 1) / world
        z3 = comm_bytes(one_b, Setting(strategy="zero3", world=world, per_node=world))
        # Everything gathered twice per micro-batch but the last block (kept from forward to backward): once.
        assert z3 == {"all_gather": pytest.approx(2 * (2 * n - one_b.block_params) * ring),
                      "reduce_scatter": pytest.approx(4 * n * ring)}
        z2 = comm_bytes(one_b, Setting(strategy="zero2", world=world, per_node=world))
        assert z2["all_gather"] == pytest.approx(2 * n * ring)
        assert comm_bytes(one_b, Setting(strategy="ddp", world=world, per_node=world)) == {
            "all_reduce": pytest.approx(2 * 4 * n * ring)}
    # hsdp over 4 nodes of 8: zero3 inside a node, the sharded gradients all-reduced across the 4 groups.
    h = comm_bytes(one_b, Setting(strategy="hsdp", world=32, per_node=8))
    assert h["all_reduce"] == pytest.approx(2 * 4 * n / 8 * 3 / 4)
    assert comm_bytes(one_b, Setting(world=1)) == {}


def test_deepspeed_zero2_reduces_per_micro_batch_in_buckets(one_b: ModelShape) -> None:
    """DeepSpeed ZeRO-2 (bf16, grad_accum 2): each micro-batch's gradients go out in 5e8-element buckets; the
    buckets that hold slices of several ranks' partitions (one per partition boundary) are all-reduced, the rest
    reduced to their owner (tests/dist/test_deepspeed.py measures the one-bucket case on gloo)."""
    n, bucket = one_b.params, 5e8
    assert n > 2 * bucket  # the 1B shape fills three buckets
    got = comm_bytes(one_b, Setting(backend="deepspeed", strategy="zero2", world=2, per_node=2, grad_accum=2))
    # 2 bytes (bf16) x 2 micro-batches; one boundary: one bucket all-reduced (2B(n-1)/n), the rest reduced (B).
    assert got == {"all_reduce": pytest.approx(2 * 2 * 2 * bucket / 2), "reduce": pytest.approx(2 * 2 * (n - bucket)),
                   "all_gather": pytest.approx(2 * n / 2)}
    # With more boundaries than buckets (4 ranks: 3 boundaries, under 3 buckets) every bucket is all-reduced.
    four = comm_bytes(one_b, Setting(backend="deepspeed", strategy="zero2", world=4, per_node=4))
    assert set(four) == {"all_reduce", "all_gather"} and four["all_reduce"] == pytest.approx(2 * 2 * n * 3 / 4)


def test_a_job_across_nodes_pays_the_inter_node_network(one_b: ModelShape) -> None:
    one_node = step_time(one_b, Setting(strategy="zero3", micro_batch_size=1, world=8, per_node=8), H200)
    two_nodes = step_time(one_b, Setting(strategy="zero3", micro_batch_size=1, world=16, per_node=8), H200)
    hsdp = step_time(one_b, Setting(strategy="hsdp", micro_batch_size=1, world=16, per_node=8), H200)
    assert two_nodes.terms["communication"] > one_node.terms["communication"]
    assert hsdp.seconds < two_nodes.seconds  # hsdp keeps the gathers on NVLink


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_auto_picks_hsdp_for_a_job_across_nodes_only(nodes: int) -> None:
    """Llama-3-8B full fine-tuning on nodes of 8 H200: across nodes hsdp keeps the gathers on NVLink and wins
    (by ~18% over zero2 on 2 nodes with the table's H200 rates); on one node hsdp is zero3 and is not offered."""
    cfg = _cfg("model.preset=llama-3-8b", "parallel.strategy=auto")
    plan = make_plan(cfg, preset_config("llama-3-8b"), H200, world=8 * nodes, per_node=8)
    assert plan.pick is not None and plan.pick.fits
    assert (plan.pick.setting.strategy == "hsdp") == (nodes > 1), plan.reason()
    assert plan.pick.setting.shard_size is None  # auto: the group is one node


def _cfg(*overrides: str):
    return load_config("bench/bench.yaml", ["data.train_file=examples/data/tasks.jsonl", *overrides])


def test_search_refuses_what_does_not_fit_and_names_the_smallest_fix() -> None:
    # FSDP2 on the one GPU (the direct path's smaller reserve makes full checkpointing the smallest fix there).
    cfg = _cfg("model.preset=llama-3.2-1b", "parallel.strategy=zero2", "train.micro_batch_size=8",
               "train.seq_len=4096", "parallel.one_gpu=fsdp2")
    # A 24 GiB host (as this test's machine had, which it read before --host-memory) rules offload out.
    h100 = replace(lookup("h100"), host_memory_bytes=24 * GIB)
    plan = make_plan(cfg, preset_config("llama-3.2-1b"), h100, world=1, per_node=1)
    assert not plan.configured.fits
    line = refusal(plan)
    assert line is not None and "\n" not in line
    assert line.startswith("predicted ") and "GiB per GPU > 75 GiB usable on h100" in line
    assert "train.micro_batch_size=" in line and "train.grad_accum=" in line and line.endswith("--force runs anyway")
    assert all(c.fits for c in plan.result.candidates if c.usable)
    # Half the sequence fits an H200 as it is.
    half = _cfg("model.preset=llama-3.2-1b", "parallel.strategy=zero2", "train.micro_batch_size=8")
    assert refusal(make_plan(half, preset_config("llama-3.2-1b"), H200, world=1, per_node=1)) is None


def test_auto_takes_the_fastest_that_fits_and_keeps_what_the_config_sets() -> None:
    cfg = _cfg("model.preset=llama-3.2-1b", "parallel.strategy=auto", "train.micro_batch_size=auto")
    resolved, plan = resolve_auto(cfg, preset_config("llama-3.2-1b"), H200, world=1, per_node=1)
    usable = [c for c in plan.result.candidates if c.usable]
    assert plan.pick is max(usable, key=lambda c: (c.time.tokens_per_sec_per_gpu, -c.memory.total))
    assert resolved.parallel.strategy == plan.pick.setting.strategy
    assert resolved.train.micro_batch_size == plan.pick.setting.micro_batch_size
    # What the config sets explicitly stays: the search only varies the rest.
    fixed = _cfg("model.preset=llama-3.2-1b", "parallel.strategy=auto", "parallel.backend=deepspeed",
                 "parallel.activation_checkpointing=full")
    resolved, plan = resolve_auto(fixed, preset_config("llama-3.2-1b"), H200, world=1, per_node=1)
    assert (resolved.parallel.backend, resolved.parallel.activation_checkpointing) == ("deepspeed", "full")
    assert resolved.train.micro_batch_size == 4  # bench.yaml sets it


def test_nothing_fits_is_refused_in_one_line() -> None:
    cfg = _cfg("model.preset=llama-3-70b", "parallel.strategy=auto", "train.micro_batch_size=auto")
    # 4 GiB: at 8 GiB DeepSpeed ZeRO-Infinity (parameters on the host) with every activation on the host fits
    small = replace(lookup("l4"), memory_bytes=4 * GIB)
    with pytest.raises(ShardtuneError, match="no way to run this config fits on l4"):
        resolve_auto(cfg, preset_config("llama-3-70b"), small, world=1, per_node=1)


def test_plan_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "examples/tiny.yaml", "--gpu", "a100-80gb", "--nproc", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["name"] == "a100-80gb" and out["world"] == 4 and out["pick"]
    for c in out["candidates"]:
        assert {"backend", "strategy", "offload", "activation_checkpointing", "micro_batch_size", "memory_gib",
                "host_memory_gib", "tokens_per_sec_per_gpu", "fits"} <= set(c)
        assert c["memory_gib"]["total"] >= c["memory_gib"]["allocated"] > 0


def test_plan_table_and_refusal_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "bench/bench.yaml", "data.train_file=examples/data/tasks.jsonl", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "<- pick" in out and "<- config" in out and "tok/s/GPU" in out
    code = main(["validate", "bench/bench.yaml", "data.train_file=examples/data/tasks.jsonl", "--gpu", "h100",
                 "train.seq_len=4096", "train.micro_batch_size=8"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: predicted ") and err.count("\n") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "tpu-v9"], "--gpu"),
    (["--gpu", "h100", "--gpu-memory", "lots"], "lots"),
    (["--gpu-memory", "80GiB", "--calibration", "/nonexistent/cal.json"], "--calibration"),
    (["--nnodes", "0"], "--nnodes"),
    (["--gpu", "h100", "--host-memory", "512"], "host memory '512': give a unit"),
])
def test_bad_plan_input_is_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "examples/tiny.yaml", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_models_the_planner_cannot_read_are_refused(tmp_path) -> None:
    enc_dec = tmp_path / "t5"
    enc_dec.mkdir()
    (enc_dec / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    assert main(["plan", "examples/tiny.yaml", f"model.path={enc_dec}", "model.preset=null", "--gpu", "h100"]) == 2
    from types import SimpleNamespace

    with pytest.raises(ShardtuneError, match="the planner needs the model's sizes"):
        from shardtune.plan.shape import _width

        _width(SimpleNamespace(model_type="odd"), "hidden_size", "n_embd")


def test_calibration_file_replaces_the_tables_rates(tmp_path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"name": "h200", "bf16_flops": 500e12, "matmul_efficiency": 0.7}))
    hw = resolve_hardware("h200", None, str(cal))
    assert hw.bf16_flops == 500e12 and hw.memory_bytes == H200.memory_bytes
    assert resolve_hardware("h100", "40GiB", str(cal)).memory_bytes == 40 * GIB  # another type: table + memory


def test_host_memory_is_checked_only_where_it_is_known(capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU type named on a login node says nothing of the GPU nodes' host memory: the login node's own RAM
    must not refuse an 8B ZeRO-3 + CPU-offload run there (it did: 188 GiB of host needed > 24 GiB here)."""
    cfg = _cfg("model.preset=llama-3-8b", "parallel.backend=deepspeed", "parallel.strategy=zero3",
               "parallel.offload=optimizer", "parallel.activation_checkpointing=full", "train.micro_batch_size=2")
    named = resolve_hardware("h100")
    assert named.host_memory_bytes is None
    plan = make_plan(cfg, preset_config("llama-3-8b"), named, world=8, per_node=8)
    assert plan.result.host_capacity is None and plan.configured.usable and refusal(plan) is None
    # Named with --host-memory, it is checked: the offloaded states need more than 100 GiB of the node's host.
    small = resolve_hardware("h100", host_memory="100GiB")
    plan = make_plan(cfg, preset_config("llama-3-8b"), small, world=8, per_node=8)
    assert plan.result.host_capacity == 100 * GIB and not plan.configured.usable
    line = refusal(plan)
    assert line is not None and line.startswith("predicted ") and "GiB of host memory per node > 100 GiB" in line
    big = resolve_hardware("h100", host_memory="2TiB")
    assert make_plan(cfg, preset_config("llama-3-8b"), big, world=8, per_node=8).configured.usable
    # A run that starts here (train) counts this machine's memory, as the local GPU's plan does.
    from shardtune.plan.hardware import local_host_memory

    assert resolve_hardware("h100", local_host=True).host_memory_bytes == local_host_memory() > 0
    if not torch.cuda.is_available():  # no GPU here and none named: no hardware to attach the host to
        with pytest.raises(ShardtuneError, match="--host-memory: also name the GPU type with --gpu"):
            resolve_hardware(None, host_memory="1TiB")
    assert main(["plan", "examples/tiny.yaml", "--gpu", "h100", "--host-memory", "1TiB"]) == 0
    assert "host 1024 GiB per node" in capsys.readouterr().out


def test_frozen_weights_kept_whole_are_neither_gathered_nor_sharded(eight_b: ModelShape) -> None:
    """parallel.shard_frozen=false (8B LoRA, bf16 base): on one GPU no gathered copy of the base (zero2 held every
    block's, 13 GiB; a fused loss the root's, 2 GiB) and no copy time; on 8 GPUs the base is whole on each (its
    15 GiB instead of an eighth) and only the adapters are all-gathered. A base in fp32 under bf16 stays sharded."""
    from shardtune.plan.speed import gather_copy_seconds

    h200 = lookup("h200")
    for strategy in ("zero2", "zero3"):
        s = Setting(peft="lora", strategy=strategy, micro_batch_size=2, fused_loss=True)
        local = replace(s, shard_frozen=False)
        assert gpu_memory(eight_b, s).terms["gathered_parameters"] >= 1.9 * GIB
        assert "gathered_parameters" not in gpu_memory(eight_b, local).terms
        assert gather_copy_seconds(eight_b, local, h200) < gather_copy_seconds(eight_b, s, h200) / 100
    eight = Setting(peft="lora", world=8, per_node=8)
    base = eight_b.params * 2
    assert gpu_memory(eight_b, replace(eight, shard_frozen=False)).terms["parameters"] == pytest.approx(
        gpu_memory(eight_b, eight).terms["parameters"] + base * 7 / 8)
    assert comm_bytes(eight_b, replace(eight, shard_frozen=False))["all_gather"] < \
        comm_bytes(eight_b, eight)["all_gather"] / 50
    fp32_base = replace(eight, base_dtype="fp32", shard_frozen=False)
    assert not fp32_base.frozen_local and comm_bytes(eight_b, fp32_base) == comm_bytes(eight_b, replace(
        fp32_base, shard_frozen=True))


def test_shard_frozen_false_is_refused_where_it_does_not_apply() -> None:
    from shardtune.parallel import check_combination

    tiny = "examples/tiny.yaml"
    with pytest.raises(ShardtuneError, match=r"parallel\.strategy=ddp does not do.*parallel\.shard_frozen=true"):
        check_combination(load_config(tiny, ["parallel.strategy=ddp", "parallel.shard_frozen=false"]))
    with pytest.raises(ShardtuneError, match=r"parallel\.shard_frozen: false is FSDP2's"):
        check_combination(load_config(tiny, ["parallel.backend=deepspeed", "parallel.shard_frozen=false"]))
    check_combination(load_config(tiny, ["parallel.strategy=zero2", "parallel.shard_frozen=false"]))


def test_shard_frozen_auto_keeps_the_base_whole_on_one_process_only() -> None:
    """parallel.shard_frozen: auto (the default) is false on one process (measured faster and smaller on one H200)
    and true on several; the planner prices what the engine will run, and an explicit value wins. DeepSpeed takes
    auto (it has nothing to keep whole) and ddp takes it (every weight is whole anyway)."""
    from shardtune.parallel import check_combination
    from shardtune.parallel.fsdp2 import frozen_whole
    from shardtune.plan.setting import setting_from_config

    tiny = "examples/tiny.yaml"
    cfg = load_config(tiny, ["peft.method=lora"])
    assert cfg.parallel.shard_frozen == "auto"
    assert frozen_whole(cfg.parallel, 1) and not frozen_whole(cfg.parallel, 2)
    assert setting_from_config(cfg, 1, 1).frozen_local and not setting_from_config(cfg, 8, 8).frozen_local
    for value, world, whole in (("true", 1, False), ("false", 8, True)):
        explicit = load_config(tiny, ["peft.method=lora", f"parallel.shard_frozen={value}"])
        assert frozen_whole(explicit.parallel, world) is whole
        assert setting_from_config(explicit, world, world).frozen_local is whole
    for extra in (["parallel.strategy=ddp"], ["parallel.backend=deepspeed"]):
        check_combination(load_config(tiny, ["peft.method=lora", *extra]))
    from shardtune.plan import describe

    assert "frozen base whole on each GPU" in describe(setting_from_config(cfg, 1, 1))  # what `plan` prints
    assert "frozen" not in describe(setting_from_config(cfg, 2, 2))


def test_the_search_weighs_the_frozen_base_whole_against_sharded_on_several_gpus() -> None:
    """Under parallel.strategy: auto on 8 GPUs, 8B LoRA (bf16 base): each FSDP2 zero2 / zero3 candidate is priced
    twice, sharded and whole ("+w"); at micro-batch 2 whole wins (no all-gather of the base: 15 GiB of it per
    GPU) and the pick carries parallel.shard_frozen=false to the workers. An explicit true keeps it sharded; on
    one GPU nothing is doubled (auto is whole there)."""
    from shardtune.models.build import load_hf_config
    from shardtune.plan import auto_overrides, config_for_auto
    from shardtune.plan.report import table

    args = ["data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3-8b", "peft.method=lora",
            "parallel.strategy=auto", "train.micro_batch_size=2"]
    h100 = lookup("h100")

    def plan_of(*extra: str, world: int = 8):
        cfg = load_config("bench/bench.yaml", [*args, *extra])
        return cfg, make_plan(cfg, load_hf_config(cfg.model), h100, world=world, per_node=world)

    cfg, plan = plan_of()
    kinds = {(c.setting.backend, c.setting.strategy, c.setting.shard_frozen) for c in plan.result.candidates}
    assert {("fsdp2", "zero3", True), ("fsdp2", "zero3", False), ("fsdp2", "zero2", False)} <= kinds
    assert ("fsdp2", "ddp", False) not in kinds and ("deepspeed", "zero3", False) not in kinds
    pick = plan.pick.setting
    assert not pick.shard_frozen and pick.frozen_local
    assert plan.pick.memory.terms["parameters"] > 14 * GIB  # the whole bf16 base
    chosen = config_for_auto(cfg, pick, plan.auto)
    assert chosen.parallel.shard_frozen is False
    assert "parallel.shard_frozen=false" in auto_overrides(chosen, plan.auto)
    assert any("+w" in line for line in table(plan))
    _, kept = plan_of("parallel.shard_frozen=true")
    assert kept.pick.setting.shard_frozen and not kept.pick.setting.frozen_local
    _, one = plan_of(world=1)
    assert all(not c.setting.shard_frozen for c in one.result.candidates if c.setting.peft != "none")


def test_a_refusal_names_the_fused_loss_when_the_logits_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """8B QLoRA at 131,072 tokens: the plain loss's logits alone (188 GiB per sequence) exceed an H200. The one
    line says Liger's fused loss never makes them, and no PEFT method (it is QLoRA already)."""
    args = ["validate", "bench/bench.yaml", "data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3.1-8b",
            "train.seq_len=131072", "train.micro_batch_size=1", "peft.method=qlora", "model.liger=false",
            "parallel.activation_checkpointing=full", "--gpu", "h200"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.liger=loss (Liger's fused loss never makes the 188 GiB of logits" in err and "peft" not in err
    assert err.count("\n") == 1
    assert main(["plan", *args[1:-2], "model.liger=loss", "--gpu", "h200"]) == 0  # with it, it fits (it trained,
    config = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("config"))  # 2026-12-04)
    assert config.endswith(", fits")


def test_float8_is_priced_faster_and_smaller_only_where_it_pays(eight_b):
    """train.float8: compiled LoRA gains on the base's matmuls and saves float8 copies in place of bf16; eager
    blocks keep their bf16 inputs, and eager LoRA also forms the frozen weights' gradients (dropped)."""
    h200 = lookup("h200")
    base = Setting(strategy="zero2", peft="lora", compile=True, activation_checkpointing="full", micro_batch_size=2)
    f8 = replace(base, float8="tensorwise")
    assert step_time(eight_b, f8, h200).seconds < step_time(eight_b, base, h200).seconds
    assert activations(eight_b, f8)[1] < activations(eight_b, base)[1]
    eager, eager_f8 = replace(base, compile=False), replace(base, compile=False, float8="tensorwise")
    assert activations(eight_b, eager_f8) == activations(eight_b, eager)
    gain_compiled = step_time(eight_b, base, h200).seconds - step_time(eight_b, f8, h200).seconds
    gain_eager = step_time(eight_b, eager, h200).seconds - step_time(eight_b, eager_f8, h200).seconds
    assert gain_eager < gain_compiled


def test_plan_names_float8_where_it_runs_and_pays(capsys: pytest.CaptureFixture[str]) -> None:
    lora = ["plan", "bench/bench.yaml", "data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3-8b",
            "peft.method=lora", "parallel.compile=true", "train.micro_batch_size=2",
            "parallel.activation_checkpointing=full"]
    assert main([*lora, "--gpu", "h200"]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("float8 ")]
    assert len(hint) == 1 and "train.float8=tensorwise" in hint[0] and "(+" in hint[0]
    assert main([*lora, "--gpu", "a100-80gb"]) == 0  # no float8 tensor cores
    assert "train.float8" not in capsys.readouterr().out
    assert main([*lora, "--gpu", "h200", "parallel.backend=deepspeed", "parallel.strategy=zero2"]) == 0
    assert "train.float8" not in capsys.readouterr().out  # DeepSpeed's table does not run it
    assert main([*lora, "--gpu", "h200", "train.float8=tensorwise"]) == 0  # on already: said, not hinted
    out = capsys.readouterr().out
    assert "float8 matmuls (tensorwise)" in out and "train.float8=tensorwise:" not in out
    assert "peft.base_dtype=float8: " not in out  # auto keeps the casts on one GPU already
    assert main([*lora, "--gpu", "h200", "train.float8=tensorwise", "peft.base_dtype=bf16"]) == 0
    assert "peft.base_dtype=float8: " in capsys.readouterr().out  # casting every pass: what keeping them saves


def test_a_float8_base_is_one_byte_per_adapted_weight(eight_b):
    """peft.base_dtype: float8: the adapted weights as 1-byte casts (loaded one layer at a time, so no bf16 base
    phase): 7.5 GiB less on the 8B shape's LoRA."""
    base = Setting(strategy="zero2", peft="lora", compile=True, activation_checkpointing="full", micro_batch_size=2,
                   float8="tensorwise", shard_frozen=False, fused_loss=True, liger_chunk=1024, base_dtype="bf16")
    cached = replace(base, base_dtype="float8")
    saved = model_states(eight_b, base)["parameters"] - model_states(eight_b, cached)["parameters"]
    assert saved == pytest.approx(eight_b.target_params * 1.0)  # 2 bytes -> 1 for every adapted weight
    assert saved / GIB == pytest.approx(6.5, abs=0.5)
    assert gpu_memory(eight_b, base).allocated - gpu_memory(eight_b, cached).allocated == pytest.approx(saved)
    # auto keeps the casts where the base is whole on the GPU, not where FSDP2 shards it, nor with DoRA
    auto = replace(base, base_dtype="auto")
    assert auto.base_float8 and model_states(eight_b, auto) == model_states(eight_b, cached)
    for other in (replace(auto, shard_frozen=True), replace(auto, dora=True), replace(auto, float8="rowwise")):
        assert not other.base_float8
    assert model_states(eight_b, replace(auto, dora=True)) == model_states(eight_b, base)


@pytest.mark.parametrize("installed", [False, True])
def test_the_plan_prices_compile_and_liger_where_the_run_goes_without(monkeypatch, installed) -> None:
    """`shardtune plan` names the opt-in settings the chosen run goes without on a GPU, priced: parallel.compile
    where the backend runs it and it pays 5%, and liger-kernel where model.liger: auto cannot take it here."""
    from conftest import ROOT

    from shardtune.models import liger_rules
    from shardtune.models.build import load_hf_config
    from shardtune.plan.hardware import GPUS
    from shardtune.plan.report import summary_lines

    monkeypatch.setattr(liger_rules, "liger_installed", lambda: installed)
    one_b = str(ROOT / "examples" / "llama-1b.yaml")

    def lines(*overrides: str, gpu: str = "h200"):
        cfg = load_config(one_b, list(overrides))
        hw = GPUS["h200"] if gpu == "h200" else replace(GPUS["h200"], name="cpu")
        plan = make_plan(cfg, load_hf_config(cfg.model), hw, world=1, per_node=1)
        return plan, {line.split()[0]: line for line in summary_lines(plan)}

    plan, said = lines("parallel.compile=false", "model.liger=false")
    compiled = plan.alternatives["compile"]
    assert compiled.setting.compile and compiled.time.tokens_per_sec_per_gpu > 1.05 * \
        plan.chosen().time.tokens_per_sec_per_gpu
    assert f"parallel.compile=true: {compiled.time.tokens_per_sec_per_gpu:,.0f} tokens/s" in said["compile"]
    assert "liger" not in said  # turned off: not advice
    plan, said = lines("parallel.compile=false")
    assert ("liger" in said) is not installed and ("liger" in plan.to_json()["alternatives"]) is not installed
    if not installed:
        liger = plan.alternatives["liger"]
        assert liger.setting.fused_loss and liger.memory.terms.get("logits", 0.0) == 0.0
        assert "pip install liger-kernel" in said["liger"] and "the logits are never made" in said["liger"]
        assert "takes Liger's kernels and fused loss" in said["liger"]  # uncompiled: both
        assert "liger" in lines("parallel.backend=deepspeed")[0].alternatives  # compiled: the fused loss
        ds_zero3 = lines("parallel.backend=deepspeed", "parallel.strategy=zero3", "parallel.compile=false")[0]
        assert ds_zero3.alternatives["liger"].setting.fused_loss  # uncompiled: the kernels and the fused loss
        head = lines("parallel.compile=false", "peft.method=lora", "peft.target_modules=[q_proj,lm_head]")[1]
        assert "takes Liger's kernels:" in head["liger"] and "logits" not in head["liger"]  # the loss stays plain
        assert "liger" not in lines("peft.method=lora", "peft.target_modules=[q_proj,lm_head]")[1]  # compiled
    assert "compile" not in lines()[1]  # already compiled
    assert "compile" not in lines("parallel.compile=false", "parallel.backend=deepspeed",
                                  "parallel.strategy=zero3")[0].alternatives  # a combination DeepSpeed refuses
    assert lines("parallel.compile=false", gpu="cpu")[0].alternatives == {}
    # the config's own check would refuse compile with the recording and checkpointing (torch >= 2.11): no advice
    assert "compile" in lines("parallel.compile=false", "parallel.activation_checkpointing=full")[0].alternatives
    assert "compile" not in lines("parallel.compile=false", "parallel.activation_checkpointing=full",
                                  "log.memory_snapshot=[3,3]")[0].alternatives
    assert "compile" in lines("parallel.compile=false", "log.memory_snapshot=[3,3]")[0].alternatives


def test_a_kept_float8_base_saves_its_per_pass_casts(eight_b):
    """Casting LoRA's frozen base at every pass reads each weight and writes its cast three times a step under
    full checkpointing; kept casts skip that. One H100, 8B LoRA, table 2's settings (call 74): 12,577 tokens/s
    kept against 11,672 casting every pass, 1.078x; predicted within 1%. Without float8 nothing changes."""
    base = Setting(strategy="zero3", peft="lora", compile=True, activation_checkpointing="full", micro_batch_size=2,
                   float8="tensorwise", shard_frozen=False, fused_loss=True, liger_chunk=1024, one_gpu="direct",
                   base_dtype="bf16", checkpoint_in_compile=False)  # call 74: the checkpoint around the blocks
    h100 = lookup("h100")
    per_pass, kept = (step_time(eight_b, s, h100).tokens_per_sec_per_gpu
                      for s in (base, replace(base, base_dtype="auto")))
    assert kept / per_pass == pytest.approx(12_577 / 11_672, rel=0.01)
    plain = replace(base, float8="false")
    auto = replace(plain, base_dtype="auto")
    assert not auto.base_float8 and step_time(eight_b, plain, h100) == step_time(eight_b, auto, h100)


def test_long_sequences_take_the_checkpoint_around_the_compiled_blocks_where_inside_does_not_fit() -> None:
    """checkpoint_in_compile's auto puts full checkpointing inside the compiled blocks (faster at 4,096 tokens), whose
    backward holds 3.5 x p x f bytes per token more (6.25 GiB at 65,536 tokens of the 8B, call 113). Around is priced
    beside it: 8B QLoRA at 98,304 tokens on an H100 does not fit inside and fits around, faster than the activation
    offload; the refusal names the flag, `strategy: auto` takes it (and its workers' overrides carry it). At 4,096
    tokens the pick keeps auto (inside)."""
    from shardtune.plan import auto_overrides
    from shardtune.plan.report import table

    given = ["model.preset=llama-3.1-8b", "peft.method=qlora", "parallel.compile=true", "train.micro_batch_size=1",
             "parallel.activation_checkpointing=full", "model.liger=loss", "data.packing=false"]
    hf, h100 = preset_config("llama-3.1-8b"), lookup("h100")
    plan = make_plan(_cfg(*given, "train.seq_len=98304", "parallel.strategy=zero3"), hf, h100, world=1, per_node=1)
    assert not plan.configured.fits and plan.configured.setting.checkpoint_traced
    around = plan.pick.setting
    assert around.checkpoint_in_compile is False and not around.checkpoint_traced and not around.activation_offload
    offloaded = max(c.time.tokens_per_sec_per_gpu for c in plan.result.candidates
                    if c.usable and c.setting.activation_offload)
    assert plan.pick.time.tokens_per_sec_per_gpu > offloaded
    line = refusal(plan)
    assert line and line.split(": ", 1)[1].startswith("parallel.checkpoint_in_compile=false fits"), line
    # the other fix is another way (not zero2 + the same flag), and names only what must change (the embedding's
    # auto keeps it on the GPU off the direct path by itself)
    assert line.endswith("or parallel.activation_offload=true fits (44 GiB); --force runs anyway"), line
    assert "around the compiled blocks" in plan.reason() and any("full+a" in row for row in table(plan))
    resolved, auto_plan = resolve_auto(_cfg(*given, "train.seq_len=98304", "parallel.strategy=auto"), hf, h100,
                                       world=1, per_node=1)
    assert resolved.parallel.checkpoint_in_compile is False and not resolved.parallel.activation_offload
    assert "parallel.checkpoint_in_compile=false" in auto_overrides(resolved, auto_plan.auto)
    short, _ = resolve_auto(_cfg(*given, "train.seq_len=4096", "parallel.strategy=auto",
                                 "parallel.activation_checkpointing=full"), hf, h100, world=1, per_node=1)
    assert short.parallel.checkpoint_in_compile == "auto"


def test_checkpointing_the_first_blocks_only_sits_between_full_and_none(eight_b: ModelShape) -> None:
    """parallel.checkpoint_blocks: N of the L blocks checkpointed is full checkpointing at N = L and none at N = 0;
    between, each block left out keeps its activations (memory) and skips its recompute (FLOPs and weight passes),
    and backward starts without a recompute, its last block's activations kept; the first recompute follows once
    they are freed, with one block input fewer than full checkpointing's start (8B LoRA, compiled, table 2's
    micro-batch: one block left out peaked 0.03 GiB under the defaults, call 134; two left out run faster, at
    0.11 GiB more, calls 135-136)."""
    from shardtune.plan.speed import weight_passes

    layers = eight_b.layers
    full = Setting(micro_batch_size=2, seq_len=2048, activation_checkpointing="full", peft="lora", compile=True,
                   precision="bf16", fused_loss=True)
    none = replace(full, activation_checkpointing="none")
    for n, same in ((layers, full), (layers + 5, full), (0, none)):
        s = replace(full, checkpoint_blocks=n)
        assert gpu_memory(eight_b, s).allocated == gpu_memory(eight_b, same).allocated
        assert train_flops_per_token(eight_b, s) == train_flops_per_token(eight_b, same)
        assert weight_passes(eight_b, s) == weight_passes(eight_b, same)
    two_out = replace(full, checkpoint_blocks=layers - 2)
    saved, recompute = activations(eight_b, two_out)
    block_input = 2 * eight_b.hidden * 4096
    whole = activations(eight_b, none)[0] / layers
    assert saved == (layers - 2) * block_input + 2 * whole and recompute == activations(eight_b, full)[1]
    flops = [train_flops_per_token(eight_b, s) for s in (none, two_out, full)]
    assert flops[0] < flops[1] < flops[2]
    assert flops[2] - flops[1] == pytest.approx(2 / layers * (flops[2] - flops[0]))
    assert weight_passes(eight_b, two_out) == 2 + (layers - 2) / layers
    h100 = lookup("h100")
    assert step_time(eight_b, two_out, h100).seconds < step_time(eight_b, full, h100).seconds
    assert gpu_memory(eight_b, full).phase == "backward start"
    # two left out: the kept blocks' start, their compiled backward's own (memory.COMPILED_BACKWARD), over full's
    # (17.10 GiB against 16.98, calls 135-136)
    assert gpu_memory(eight_b, two_out).allocated > gpu_memory(eight_b, full).allocated
    one_out = gpu_memory(eight_b, replace(full, checkpoint_blocks=layers - 1))
    assert one_out.phase == "backward start"
    assert one_out.allocated == pytest.approx(gpu_memory(eight_b, full).allocated - block_input)
    # far enough from full checkpointing the peak holds the kept blocks' activations, without a recompute
    three_out = replace(full, checkpoint_blocks=layers - 3)
    assert gpu_memory(eight_b, three_out).terms["activations"] == pytest.approx(activations(eight_b, three_out)[0])


def test_checkpoint_blocks_is_refused_in_one_line_where_it_has_no_meaning() -> None:
    for extra, match in ((["parallel.activation_checkpointing=none"], "needs parallel.activation_checkpointing=full"),
                         (["parallel.activation_checkpointing=selective"], "needs parallel.activation_checkpointing")):
        with pytest.raises(ShardtuneError, match=match) as err:
            _cfg("parallel.checkpoint_blocks=2", *extra)
        assert "\n" not in str(err.value)


def test_strategy_auto_keeps_checkpoint_blocks_where_full_checkpointing_runs() -> None:
    """The search prices the config's parallel.checkpoint_blocks with full checkpointing only (none and selective
    run without it; the activation offload with it), and writes a pick the config's own check accepts, its workers
    too."""
    from shardtune.plan import auto_overrides

    given = ["model.preset=llama-3-8b", "peft.method=lora", "parallel.compile=true", "train.micro_batch_size=2",
             "parallel.activation_checkpointing=full", "parallel.checkpoint_blocks=29", "parallel.strategy=auto"]
    cfg = _cfg(*given)
    resolved, plan = resolve_auto(cfg, preset_config("llama-3-8b"), lookup("h100"), world=1, per_node=1)
    p = resolved.parallel
    assert (p.checkpoint_blocks == 29) == (p.activation_checkpointing == "full")
    assert {c.setting.checkpoint_blocks for c in plan.result.candidates
            if c.setting.activation_checkpointing != "full"} == {None}
    assert {c.setting.checkpoint_blocks for c in plan.result.candidates
            if c.setting.activation_checkpointing == "full"} == {29}
    assert any(c.setting.activation_offload for c in plan.result.candidates
               if c.setting.activation_checkpointing == "full")
    type(p).model_validate(p.model_dump())  # the pick as written passes the section's own checks
    worker = _cfg(*given, *auto_overrides(resolved, plan.auto))  # what the launcher's workers load
    assert worker.parallel.checkpoint_blocks == p.checkpoint_blocks
    assert worker.parallel.activation_checkpointing == p.activation_checkpointing


def test_strategy_auto_checkpoints_the_fewest_first_blocks_that_fit() -> None:
    """Eager blocks on a GPU where full checkpointing fits and none does not: the search prices full checkpointing
    of the first N blocks only, the smallest N that fits (faster than all L, N - 1 does not fit), picks it, and the
    workers' overrides carry it. Compiled blocks have the memory budgets for that trade instead."""
    from shardtune.plan import auto_overrides
    from shardtune.plan.search import price

    given = ["model.preset=llama-3-8b", "peft.method=lora", "train.micro_batch_size=2", "parallel.strategy=auto"]
    small = replace(lookup("h100"), memory_bytes=32 * GIB)
    resolved, plan = resolve_auto(_cfg(*given), preset_config("llama-3-8b"), small, world=1, per_node=1)
    chosen = plan.chosen()
    n = chosen.setting.checkpoint_blocks
    assert chosen.setting.activation_checkpointing == "full" and n is not None and 0 < n < 32, chosen.setting
    full = price(plan.shape, chosen.setting.replace(checkpoint_blocks=None), small, plan.result.capacity, None)
    one_fewer = price(plan.shape, chosen.setting.replace(checkpoint_blocks=n - 1), small, plan.result.capacity, None)
    assert full.usable and not one_fewer.usable
    assert chosen.time.tokens_per_sec_per_gpu > full.time.tokens_per_sec_per_gpu
    assert f"parallel.checkpoint_blocks={n}" in auto_overrides(resolved, plan.auto)
    worker = _cfg(*given, *auto_overrides(resolved, plan.auto))
    assert worker.parallel.checkpoint_blocks == n and worker.parallel.activation_checkpointing == "full"
    compiled = resolve_auto(_cfg(*given, "parallel.compile=true"), preset_config("llama-3-8b"), small, world=1,
                            per_node=1)[1]
    assert all(c.setting.checkpoint_blocks is None for c in compiled.result.candidates)
    # a config that sets the checkpointing keeps every block checkpointed
    every = resolve_auto(_cfg(*given, "parallel.activation_checkpointing=full"), preset_config("llama-3-8b"), small,
                         world=1, per_node=1)[1].chosen().setting
    assert every.activation_checkpointing == "full" and every.checkpoint_blocks is None


def test_a_fix_that_changes_the_checkpointing_drops_checkpoint_blocks() -> None:
    """The config's check refuses parallel.checkpoint_blocks beside any checkpointing but full: a refusal that names
    another checkpointing as the fix names `parallel.checkpoint_blocks=null` with it, so the line works as given."""
    given = ["model.preset=llama-3-8b", "peft.method=lora", "train.micro_batch_size=4", "parallel.strategy=zero3",
             "parallel.activation_checkpointing=full", "parallel.checkpoint_blocks=8"]
    cfg = _cfg(*given)
    line = refusal(make_plan(cfg, preset_config("llama-3-8b"), replace(lookup("h100"), memory_bytes=24 * GIB),
                             world=1, per_node=1))
    assert "parallel.activation_checkpointing=selective" in line and "parallel.checkpoint_blocks=null" in line, line
    fix = line.split(": ", 1)[1].split(" fits")[0].split()
    assert _cfg(*given, *fix).parallel.checkpoint_blocks is None  # the fix as given passes the config's check
