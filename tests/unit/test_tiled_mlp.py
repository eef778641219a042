"""parallel.tiled_mlp: each block's MLP over tiles of the tokens, each tile under its own checkpoint. The same losses
and gradients as untiled (eager, under full checkpointing, with the activation offload, compiled with the checkpoint
around), the MLP's intermediates no longer held by the block (the peak stops growing with the MLP's width), the
planner's count of what a tiled block saves, and the refusals."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from conftest import ROOT, block_saved_bytes, offload_test_model, two_steps

from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.models.presets import preset_config
from shardtune.parallel import checkpoint_traced
from shardtune.parallel.tiled_mlp import TiledForward, tile_mlps
from shardtune.plan.memory import (
    TILE_TRANSIENT,
    TILED_HIDDEN_TRANSIENT,
    activation_bytes_per_token_layer,
    backward_transient,
    gpu_memory,
)
from shardtune.plan.setting import Setting
from shardtune.plan.shape import model_shape
from shardtune.plan.speed import train_flops_per_token

TINY = str(ROOT / "examples" / "tiny.yaml")


def _two_steps(overrides: list[str], offload: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps of examples/tiny.yaml's model (fp32, 2 x 32 tokens): their losses and the summed gradients."""
    model, blocks, _hooks = offload_test_model(overrides, "cpu", offload)
    if any(o.startswith("parallel.tiled_mlp") for o in overrides):
        assert all(isinstance(b.mlp.__dict__["forward"], TiledForward) for b in blocks)
    return two_steps(model, torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("settings", [["parallel.activation_checkpointing=none"],
                                      ["parallel.activation_checkpointing=full"],
                                      ["parallel.activation_checkpointing=full", "offload"],
                                      ["parallel.activation_checkpointing=full", "parallel.compile=true"]],
                         ids=["none", "full", "full-offload", "full-compiled"])
def test_tiles_keep_the_loss_and_gradients(settings: list[str], without_inductor) -> None:
    """64 tokens in tiles of 16 (and of 24: a short last tile) against the untiled run: the same losses, and the
    gradients to fp32 rounding (the weights' gradients are summed tile by tile)."""
    offload = "offload" in settings
    overrides = [s for s in settings if s != "offload"]
    plain_losses, plain_grads = _two_steps(overrides, offload)
    for tile in (16, 24):
        losses, grads = _two_steps([*overrides, f"parallel.tiled_mlp={tile}"], offload)
        assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compile_takes_the_checkpoint_around_the_tiles_and_inside_is_refused() -> None:
    """The tiles run outside the compiled graph (a graph break around the MLP), so checkpoint_in_compile's auto puts
    the checkpoint around the compiled blocks; true, selective checkpointing and a memory budget are refused in one
    line each."""
    base = ["parallel.compile=true", "parallel.activation_checkpointing=full", "parallel.tiled_mlp=4096"]
    assert not checkpoint_traced(load_config(TINY, base).parallel)
    assert checkpoint_traced(load_config(TINY, base[:2]).parallel)
    refused = {"parallel.checkpoint_in_compile=true": "checkpoint_in_compile=auto",  # literal words: no pattern
               "parallel.activation_checkpointing=selective": "selective",
               "parallel.activation_memory_budget=0.3": "not both"}
    for extra, words in refused.items():
        overrides = [*base, extra] + (["parallel.activation_checkpointing=none"] if "budget" in extra else [])
        with pytest.raises(ShardtuneError, match=re.escape(words)):
            load_config(TINY, overrides)


def test_a_block_without_a_dense_mlp_is_refused_and_a_copy_tiles_its_own() -> None:
    """tile_mlps names the block that has no `...MLP` module; a deep copy of a tiled model computes with its own
    weights (the forward names its module as an attribute, as CheckpointedForward does)."""
    with pytest.raises(ShardtuneError, match=r"parallel\.tiled_mlp: decoder block 0 .* no dense `mlp`"):
        tile_mlps([torch.nn.Linear(2, 2)], 8)
    model, blocks, _ = offload_test_model(["parallel.tiled_mlp=16"])
    twin = copy.deepcopy(model)
    for block in twin.model.layers:
        assert block.mlp.forward.module is block.mlp
    x = torch.randn(2, 32, model.config.hidden_size)
    torch.testing.assert_close(twin.model.layers[0].mlp(x), blocks[0].mlp(x))
    with torch.no_grad():
        twin.model.layers[0].mlp.down_proj.weight.zero_()
    assert twin.model.layers[0].mlp(x).abs().max() == 0 and blocks[0].mlp(x).abs().max() > 0


def _backward_peak(ffn: int, tile: int | None) -> int:
    """Peak of allocated CPU memory (the profiler's allocation events) above the start, over one forward and
    backward of a two-block Llama (fp32, full checkpointing, 2,048 tokens) with MLP width `ffn`. fp32, not bf16: the
    peaks are bf16's twice to the byte, in 9 s against 46 (this CPU's bf16 matmuls are ~10x slower)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.config import ParallelConfig
    from shardtune.parallel.prepare import checkpoint_and_compile

    cfg = LlamaConfig(hidden_size=128, intermediate_size=ffn, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=2, vocab_size=64, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    checkpoint_and_compile(model, list(model.model.layers),
                           ParallelConfig(activation_checkpointing="full", tiled_mlp=tile), "cpu")
    ids = torch.randint(0, 64, (1, 2048), generator=torch.Generator().manual_seed(1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def test_a_tiled_mlp_no_longer_holds_its_width_at_the_peak() -> None:
    """Untiled, widening the MLP by f raises the backward's peak by the recomputed block's 4pf and its backward's 2pf
    per token (at least 4pf measured here); tiled in 256-token tiles it adds only the tile's share (and the wider
    weights' gradients: this model trains them)."""
    tokens, p, wider = 2048, 4, 1024
    plain = _backward_peak(1536, None), _backward_peak(1536 + wider, None)
    tiled = _backward_peak(1536, 256), _backward_peak(1536 + wider, 256)
    assert plain[1] - plain[0] >= 4 * p * wider * tokens
    # a tile's share, the wider weights' gradients (3 h x f more) and a little slack
    assert tiled[1] - tiled[0] <= 6 * p * wider * 256 + 3 * p * 128 * wider + p * 128 * tokens
    assert tiled[0] < plain[0]


def test_the_planner_counts_a_tiled_block_without_its_mlp_intermediates() -> None:
    """What a tiled block saves (autograd's saved tensors of a real bf16 block on CPU, as test_plan's formula check:
    the tiles' checkpoints save their inputs, views of the MLP's input) is the formula's count less the MLP's 4pf;
    its backward holds a tile's 6pf or the rest of the block's hidden-wide gradients over every token, whichever is
    larger, and each step runs the MLP's forward once more."""
    from transformers import AutoModelForCausalLM

    cfg = preset_config("tiny-llama")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").train()
    batch, seq, tile = 2, 64, 32
    tile_mlps(list(model.model.layers), tile)
    # the tiles' inputs, which their checkpoints save through autograd (views of the MLP's input: counted once)
    measured = block_saved_bytes(model, batch, seq) / (batch * seq)
    shape = model_shape(cfg)
    s = Setting(micro_batch_size=batch, seq_len=seq, tiled_mlp=tile)
    untiled = s.replace(tiled_mlp=None)
    assert s.mlp_tiled and not s.replace(tiled_mlp=batch * seq).mlp_tiled  # one tile: run as it is
    assert measured == pytest.approx(activation_bytes_per_token_layer(shape, s), rel=0.02)
    assert (activation_bytes_per_token_layer(shape, untiled) - activation_bytes_per_token_layer(shape, s)
            == 4 * 2 * shape.ffn)
    # 128 tokens: the hidden-wide gradients (8.4 x 256 per token) outweigh a 32-token tile's 6 x 688; a 120-token
    # tile's outweigh them
    assert backward_transient(shape, s) == 2 * TILED_HIDDEN_TRANSIENT * shape.hidden * batch * seq
    assert backward_transient(shape, s.replace(tiled_mlp=120)) == 2 * TILE_TRANSIENT * shape.ffn * 120
    extra = train_flops_per_token(shape, s) - train_flops_per_token(shape, untiled)
    assert extra == 2 * shape.layers * 3 * shape.hidden * shape.ffn


def test_the_planner_prices_the_long_sequence_it_is_for() -> None:
    """8B QLoRA at 327,680 tokens (the Llama-3.1-8B shape, full checkpointing, Liger's fused loss, the activation
    offload): in 8,192-token tiles the recomputed block's MLP leaves the peak, 83.7 -> 52.2 GiB priced; one H100
    measured 51.2 (call 147, bench/RESULTS.md forty-eighth session), where the tiles alone, without the rest of the
    block's hidden-wide gradients, had priced 32.6."""
    from shardtune.models.build import load_hf_config
    from shardtune.plan.setting import setting_from_config

    overrides = ["model.preset=llama-3.1-8b", "model.max_position_embeddings=327680", "train.seq_len=327680",
                 "peft.method=qlora", "parallel.activation_checkpointing=full", "parallel.activation_offload=true"]
    overrides = ["data.train_file=examples/data/tasks.jsonl", "train.precision=bf16", "train.micro_batch_size=1",
                 "parallel.strategy=zero3", "model.liger=loss", *overrides]
    cfg = load_config(str(ROOT / "bench" / "bench.yaml"), overrides)  # the bench runs' settings
    shape = model_shape(load_hf_config(cfg.model))
    plain = setting_from_config(cfg, 1, 1, liger=True)
    bench = str(ROOT / "bench" / "bench.yaml")
    tiled = setting_from_config(load_config(bench, [*overrides, "parallel.tiled_mlp=8192"]), 1, 1, liger=True)
    assert tiled.tiled_mlp == 8192 and plain.tiled_mlp is None
    before, after = gpu_memory(shape, plain).allocated / 2**30, gpu_memory(shape, tiled).allocated / 2**30
    assert before == pytest.approx(83.7, abs=0.1) and after == pytest.approx(52.2, abs=0.1)


def test_the_search_takes_tiles_only_where_nothing_untiled_fits() -> None:
    """8B QLoRA on one H100 (128 GiB of host memory) under parallel.strategy: auto: at 131,072 tokens an untiled
    setting fits and is faster, so the pick has no tiles; at 327,680 tokens nothing untiled fits and the pick runs
    the MLPs in SEARCHED_TILE-token tiles, written into the workers' overrides; a config that fixes the checkpointing
    is refused with the tiles named as a fix."""
    from shardtune.models.build import load_hf_config
    from shardtune.plan import auto_overrides, make_plan, refusal, resolve_auto
    from shardtune.plan.hardware import lookup
    from shardtune.plan.search import SEARCHED_TILE

    def plan(seq: int, *extra: str):
        cfg = load_config(str(ROOT / "bench" / "bench.yaml"), [
            "data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3.1-8b",
            f"model.max_position_embeddings={seq}", f"train.seq_len={seq}", "train.micro_batch_size=1",
            "peft.method=qlora", "model.liger=loss", *extra])
        return cfg, make_plan(cfg, load_hf_config(cfg.model), h100, world=1, per_node=1)

    h100 = dataclasses.replace(lookup("h100"), host_memory_bytes=128 * 2**30)  # the device machine's host

    _, short = plan(131072, "parallel.strategy=auto")
    assert short.pick is not None and short.pick.setting.tiled_mlp is None
    assert any(c.setting.tiled_mlp == SEARCHED_TILE for c in short.result.candidates)  # priced, slower
    cfg, long = plan(327680, "parallel.strategy=auto")
    assert long.pick is not None and long.pick.setting.tiled_mlp == SEARCHED_TILE
    assert all(c.setting.tiled_mlp for c in long.result.candidates if c.usable)
    resolved, _ = resolve_auto(cfg, load_hf_config(cfg.model), h100, world=1, per_node=1)
    assert f"parallel.tiled_mlp={SEARCHED_TILE}" in auto_overrides(resolved, long.auto)
    _, fixed = plan(327680, "parallel.strategy=zero3", "parallel.activation_checkpointing=full",
                    "parallel.activation_offload=true")
    assert f"parallel.tiled_mlp={SEARCHED_TILE}" in refusal(fixed)
