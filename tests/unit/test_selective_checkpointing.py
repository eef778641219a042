"""parallel.activation_checkpointing: selective (per-op, as torchtitan's `selective_ac_option: op`): the same
loss and gradients as no checkpointing, with the policy saving the attention kernel's output and the 1st, 3rd,
5th and 7th matmul of each block (q, v, gate, down projections) and recomputing the other three."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import ROOT

from shardtune.config import load_config
from shardtune.models.build import build_on_meta, load_hf_config, restore_buffers
from shardtune.parallel import prepare

TINY = str(ROOT / "examples" / "tiny.yaml")


def _model(mode: str, float8: bool = False, compile: bool = False):
    cfg = load_config(TINY, [f"parallel.activation_checkpointing={mode}", f"parallel.compile={str(compile).lower()}"])
    hf_config = load_hf_config(cfg.model)
    model = build_on_meta(hf_config, "sdpa").to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    restore_buffers(model, torch.device("cpu"))
    model.train()
    if float8:
        from shardtune.models.float8 import convert_to_float8

        model.to(torch.bfloat16)
        convert_to_float8(model, "tensorwise")
    prepare.checkpoint_and_compile(model, list(model.model.layers), cfg.parallel)
    return model, hf_config.num_hidden_layers


def _loss_and_grads(mode: str, float8: bool = False, compile: bool = False):
    model, layers = _model(mode, float8, compile)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}, layers


def test_the_key_takes_selective():
    assert load_config(TINY, ["parallel.activation_checkpointing=selective"]).parallel.activation_checkpointing \
        == "selective"


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_gives_the_loss_and_gradients_of_none(mode):
    loss, grads, _ = _loss_and_grads("none")
    got_loss, got, _ = _loss_and_grads(mode)
    assert got_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def _record_decisions(monkeypatch, key) -> Counter:
    """Wrap the selective policy so that each decision it makes is counted under key(ctx, func, args, choice)
    (None: not counted)."""
    decisions: Counter = Counter()
    original = prepare.selective_policy

    def counting(counts):
        policy = original(counts)

        def decide(ctx, func, *args, **kwargs):
            choice = policy(ctx, func, *args, **kwargs)
            name = key(ctx, func, args, choice)
            if name is not None:
                decisions[name] += 1
            return choice

        return decide

    monkeypatch.setattr(prepare, "selective_policy", counting)
    return decisions


def test_selective_saves_attention_and_every_other_matmul(monkeypatch):
    def key(ctx, func, args, choice):
        if func == torch.ops.aten.mm.default or "scaled_dot_product" in str(func):
            return ("mm" if func == torch.ops.aten.mm.default else "attention", choice.name)
        return None

    decisions = _record_decisions(monkeypatch, key)
    _, _, layers = _loss_and_grads("selective")
    # Forward: 7 projections per block, q / v / gate / down saved, k / o / up recomputed; the attention saved.
    assert decisions == Counter({("mm", "MUST_SAVE"): 4 * layers, ("mm", "MUST_RECOMPUTE"): 3 * layers,
                                 ("attention", "MUST_SAVE"): layers}), decisions


def test_selective_under_compile_saves_the_same_matmuls(monkeypatch, without_inductor):
    # The policy sees the ops only while Dynamo traces the block: around a compiled block it would see Inductor's
    # kernels (mm.out), match no matmul and recompute everything. So compile traces selective's checkpoint.
    torch._dynamo.reset()

    def key(ctx, func, args, choice):
        if ctx.is_recompute:
            return None
        if func == torch.ops.aten.mm.default or "scaled_dot_product" in str(func):
            return ("mm" if func == torch.ops.aten.mm.default else "attention", choice.name)
        return None

    decisions = _record_decisions(monkeypatch, key)
    loss, grads, layers = _loss_and_grads("selective", compile=True)
    traced = decisions[("attention", "MUST_SAVE")]  # blocks Dynamo traced (a graph serves the blocks alike)
    assert 1 <= traced <= layers, decisions
    assert decisions == Counter({("mm", "MUST_SAVE"): 4 * traced, ("mm", "MUST_RECOMPUTE"): 3 * traced,
                                 ("attention", "MUST_SAVE"): traced}), decisions
    eager_loss, eager_grads, _ = _loss_and_grads("none")
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_selective_policy_runs_at_every_step_only_eager(monkeypatch, without_inductor):
    # Eager, the policy is called for every op of every block at every step (the host cost the planner prices as
    # speed.SELECTIVE_LAYER_S); traced by compile it is called while tracing only, so compiled steps pay nothing.
    decisions = _record_decisions(monkeypatch, lambda ctx, func, args, choice: "op")
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    for compiled in (False, True):
        torch._dynamo.reset()
        model, _ = _model("selective", compile=compiled)
        per_step = []
        for _ in range(3):
            before = decisions["op"]
            model(input_ids=ids, labels=ids).loss.backward()
            per_step.append(decisions["op"] - before)
        if compiled:
            assert per_step[0] > 0 and per_step[1:] == [0, 0], per_step
        else:
            assert per_step[0] > 0 and per_step[1:] == per_step[:1] * 2, per_step


def test_selective_saves_every_other_float8_matmul_too(monkeypatch):
    """train.float8's layers call aten.mm on torchao's float8 tensors (their _scaled_mm runs below the checkpoint's
    dispatch mode), so the policy sees and counts them as matmuls: the same 4 saved and 3 recomputed per block, and
    the loss of no checkpointing."""
    pytest.importorskip("torchao")

    def key(ctx, func, args, choice):
        if func not in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default) or ctx.is_recompute:
            return None
        floats8 = any("float8" in str(getattr(a, "_data", a).dtype) for a in args if hasattr(a, "dtype"))
        return (func.__name__, floats8, choice.name)

    decisions = _record_decisions(monkeypatch, key)
    loss, _, layers = _loss_and_grads("selective", float8=True)
    assert decisions == Counter({("mm.default", True, "MUST_SAVE"): 4 * layers,
                                 ("mm.default", True, "MUST_RECOMPUTE"): 3 * layers}), decisions
    assert loss == _loss_and_grads("none", float8=True)[0]
