"""parallel.checkpoint_in_compile (auto, the default: inside): each block checkpointed inside its compiled code
(torchtitan's order), so the compiled backward recomputes the block. The same losses and gradients as checkpointing
around the compiled blocks (false), the same few bytes saved per block, and the settings it cannot run with refused
in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, offload_test_model, two_steps
from torch._dynamo.utils import counters

from shardtune.config import ConfigError, load_config
from shardtune.errors import ShardtuneError
from shardtune.parallel import check_combination, checkpoint_traced

TINY = str(ROOT / "examples" / "tiny.yaml")

# What is traced, saved and recomputed is AOTAutograd's: every test here compiles through aot_eager (conftest's
# without_inductor); Inductor runs the same blocks in tests/dist's zero3:ac:compile, :around and :compile:budget.
pytestmark = pytest.mark.usefixtures("without_inductor")


def _saved_bytes(model, ids) -> int:
    """Bytes of activations autograd saves in one forward (the saved tensors the pack hook sees, less the
    parameters: a saved weight costs no memory)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in weights:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return total


_RUNS: dict[tuple[tuple[str, ...], bool], tuple] = {}  # this module's runs, made once (they are only read)


def _run(overrides: list[str], lora: bool):
    # the setting prepare makes for the checkpoint inside: off at the start of every run, so that a run that
    # needs it and does not set it shows its graph break whatever ran before
    key = (tuple(overrides), lora)
    if key not in _RUNS:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            _RUNS[key] = _run_once(overrides, lora)
    return _RUNS[key]


def _run_once(overrides: list[str], lora: bool):
    torch._dynamo.reset()
    counters.clear()
    model, _, _ = offload_test_model(["parallel.compile=true", *overrides])
    if lora:
        from shardtune.config import PeftConfig
        from shardtune.peft.lora import apply_lora

        torch.manual_seed(1)
        model = apply_lora(model, PeftConfig(method="lora", r=4), model.config.model_type)
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    losses, grads = two_steps(model, ids)
    model.zero_grad(set_to_none=True)
    compiled = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    return losses, grads, _saved_bytes(model, ids), model, compiled


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpointing_inside_the_compiled_blocks_keeps_the_losses_gradients_and_memory(ac: str) -> None:
    outside = _run([f"parallel.activation_checkpointing={ac}", "parallel.checkpoint_in_compile=false"], lora=False)
    inside = _run([f"parallel.activation_checkpointing={ac}"], lora=False)  # auto: inside
    plain = _run(["parallel.activation_checkpointing=none"], lora=False)
    assert inside[0] == pytest.approx(outside[0], rel=1e-6)
    assert inside[1].keys() == outside[1].keys()
    for name, grad in inside[1].items():
        torch.testing.assert_close(grad, outside[1][name], rtol=1e-5, atol=1e-7, msg=name)
    # transformers' own checkpointing is off under compile (its place depends on its release): shardtune's is on
    assert not inside[3].is_gradient_checkpointing and not outside[3].is_gradient_checkpointing
    # it checkpoints: full saves about what the checkpoint around the compiled blocks saves (the block inputs and a
    # few small tensors more), selective the kept matmul outputs too (around, its cache is outside autograd's
    # hooks, so not comparable here); both far less than without
    assert inside[2] < (0.5 if ac == "full" else 0.6) * plain[2], (inside[2], outside[2], plain[2])
    if ac == "full":
        assert inside[2] <= 1.1 * outside[2], (inside[2], outside[2], plain[2])
    # and all are compiled: Dynamo traced the blocks without a graph break (the checkpoint inside needs
    # allow_side_effects_under_checkpoint: transformers' output capturing sets a variable in each block's forward)
    for run in (outside, inside, plain):
        assert run[4][0] >= 1 and run[4][1] == 0, run[4]


def test_lora_blocks_checkpointed_inside_compile_keep_their_gradients() -> None:
    outside = _run(["parallel.activation_checkpointing=full", "parallel.checkpoint_in_compile=false"], lora=True)
    inside = _run(["parallel.activation_checkpointing=full", "parallel.checkpoint_in_compile=true"], lora=True)
    assert inside[0] == pytest.approx(outside[0], rel=1e-6)
    assert any("lora_" in n for n in inside[1])
    for name, grad in inside[1].items():
        torch.testing.assert_close(grad, outside[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_memory_budget_recomputes_inside_the_compiled_blocks_and_saves_what_it_allows() -> None:
    # parallel.activation_memory_budget: compile's partitioner keeps at most that share of the block's activations
    # between what recomputing all of it keeps (0) and the default (1), with the gradients of no budget. Each
    # prepare sets the process-wide value; patch puts it back for the tests after this one.
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=1.0):
        plain = _run(["parallel.activation_checkpointing=none"], lora=False)
        budgets = {b: _run([f"parallel.activation_memory_budget={b}"], lora=False) for b in (0.5, 0.0)}
        assert functorch_config.activation_memory_budget == 0.0  # the last prepare's
        offload_test_model(["parallel.compile=true"])  # unset: torch's default again
        assert functorch_config.activation_memory_budget == 1.0
    for run in budgets.values():
        assert run[0] == pytest.approx(plain[0], rel=1e-6)
        assert run[1].keys() == plain[1].keys()
        for name, grad in run[1].items():
            torch.testing.assert_close(grad, plain[1][name], rtol=1e-5, atol=1e-7, msg=name)
        assert run[4][0] >= 1 and run[4][1] == 0, run[4]  # compiled, no graph break
    low, half, high = budgets[0.0][2], budgets[0.5][2], plain[2]
    # 0 keeps the blocks' inputs (0.18 of the default here; full checkpointing inside compile 0.19); 0.5 about half
    # of the way. The partitioner bounds its own estimate (each saved node at its full size), which the saved
    # tensors the hooks see follow roughly: 0.49 of the way here (0.30 at 0.3, 0.67 at 0.7), 0.55 with LoRA
    assert low < 0.25 * high, (low, high)
    assert 0.35 < (half - low) / (high - low) < 0.65, (low, half, high)


def test_a_budget_changed_in_one_process_applies_to_the_blocks_compiled_next() -> None:
    # Dynamo's guards leave the budget out: without the reset prepare makes when the value changes, the second
    # model's blocks ran the first one's compiled code and kept its bytes (found on the GPU, call 89)
    import torch._functorch.config as functorch_config

    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    saved = []
    try:
        with functorch_config.patch(activation_memory_budget=1.0):
            torch.compiler.reset()
            for extra in ([], ["parallel.activation_memory_budget=0.0"]):
                model, _, _ = offload_test_model(["parallel.compile=true", *extra])
                model(input_ids=ids, labels=ids).loss.backward()  # compiles
                saved.append(_saved_bytes(model, ids))
    finally:
        torch.compiler.reset()  # patch puts 1.0 back without a prepare: drop the budget-0 code
    assert saved[1] < 0.5 * saved[0], saved


def test_settings_it_cannot_run_with_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.checkpoint_in_compile needs parallel\.compile=true"):
        load_config(TINY, ["parallel.checkpoint_in_compile=true"])
    with pytest.raises(ConfigError, match=r"parallel\.activation_memory_budget needs parallel\.compile=true"):
        load_config(TINY, ["parallel.activation_memory_budget=0.5"])
    with pytest.raises(ConfigError, match=r"set parallel\.activation_memory_budget or parallel\.activation_check"):
        load_config(TINY, ["parallel.compile=true", "parallel.activation_memory_budget=0.5",
                           "parallel.activation_checkpointing=full"])
    with pytest.raises(ConfigError, match=r"activation_memory_budget") as err:
        load_config(TINY, ["parallel.compile=true", "parallel.activation_memory_budget=1.5"])
    assert "\n" not in str(err.value)
    # the offload's hooks take what the budget keeps (the compiled code saves it through autograd:
    # test_activation_offload)
    check_combination(load_config(TINY, ["parallel.compile=true", "parallel.activation_memory_budget=0.5",
                                         "parallel.activation_offload=true"]))
    # full checkpointing inside the compiled blocks runs with the offload (its hooks take the block inputs the
    # compiled code saves: test_activation_offload)
    inside_offload = load_config(TINY, ["parallel.compile=true", "parallel.checkpoint_in_compile=true",
                                        "parallel.activation_checkpointing=full", "parallel.activation_offload=true"])
    check_combination(inside_offload)
    assert checkpoint_traced(inside_offload.parallel)
    # selective under compile is always traced (its policy sees the ops only then), and the offload would take
    # every output it keeps: refused
    cfg = load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=selective",
                             "parallel.activation_offload=true"])
    with pytest.raises(ShardtuneError, match=r"selective with parallel\.compile: parallel\.activation_off") as err:
        check_combination(cfg)
    assert "\n" not in str(err.value)
    # auto: around the compiled blocks with the offload, so the two run together
    auto_offload = load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=full",
                                      "parallel.activation_offload=true"])
    check_combination(auto_offload)
    assert not checkpoint_traced(auto_offload.parallel)
    # CUDA graphs: the recompute in Python that breaks them (pytorch/pytorch#154306) is gone inside, so not refused
    # there (auto or true); around (false, or auto with the offload) they are
    for inside in ([], ["parallel.checkpoint_in_compile=true"]):
        check_combination(load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=full",
                                             "parallel.compile_mode=reduce-overhead", *inside]))
    for around in (["parallel.checkpoint_in_compile=false"], ["parallel.activation_offload=true"]):
        with pytest.raises(ShardtuneError, match=r"pytorch/pytorch#154306"):
            check_combination(load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=full",
                                                 "parallel.compile_mode=reduce-overhead", *around]))
    # inside with the offload: never run with CUDA graphs, refused
    with pytest.raises(ShardtuneError, match=r"CUDA graphs with parallel\.activation_offload are not supported"):
        check_combination(load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=full",
                                             "parallel.compile_mode=reduce-overhead",
                                             "parallel.checkpoint_in_compile=true",
                                             "parallel.activation_offload=true"]))


def test_full_checkpointing_traced_by_compile_recomputes_every_op() -> None:
    # compile takes a checkpoint's ops as PREFER_RECOMPUTE, which its partitioner may override (8B LoRA float8 on
    # an H100 kept 11 GiB of matmul outputs): traced full checkpointing says MUST_RECOMPUTE for every op; eager
    # full checkpointing has no per-op policy (no dispatch mode on every op)
    from torch.utils.checkpoint import CheckpointPolicy

    from shardtune.parallel import prepare

    assert "context_fn" not in prepare.checkpoint_kwargs("full")
    decisions = []
    original = prepare.recompute_all_context

    def recording():
        forward, recompute = original()
        policy = forward.policy_fn  # the forward's mode asks the policy; the recompute's replays its choices
        forward.policy_fn = lambda *a, **k: decisions.append(policy(*a, **k)) or decisions[-1]
        return forward, recompute

    prepare.recompute_all_context = recording
    try:
        x = torch.randn(8, 8, requires_grad=True)
        kwargs = prepare.checkpoint_kwargs("full", traced=True)
        torch.utils.checkpoint.checkpoint(lambda t: (t @ t).relu().sum(), x, **kwargs).backward()
    finally:
        prepare.recompute_all_context = original
    assert decisions and set(decisions) == {CheckpointPolicy.MUST_RECOMPUTE}
    torch.testing.assert_close(x.grad, torch.autograd.functional.vjp(lambda t: (t @ t).relu().sum(), x)[1])


def test_where_the_checkpoint_goes_is_one_rule_for_the_run_and_the_planner() -> None:
    from shardtune.plan.setting import setting_from_config

    # (overrides, traced): auto is inside unless the offload needs the block inputs outside; selective always inside
    cases = [([], True), (["parallel.checkpoint_in_compile=false"], False),
             (["parallel.activation_offload=true"], False),
             (["parallel.activation_checkpointing=selective", "parallel.checkpoint_in_compile=false"], True),
             (["parallel.activation_checkpointing=none"], False), (["parallel.compile=false"], False)]
    for overrides, traced in cases:
        cfg = load_config(TINY, ["parallel.compile=true", "parallel.activation_checkpointing=full", *overrides])
        assert checkpoint_traced(cfg.parallel) is traced, overrides
        assert setting_from_config(cfg, 1, 1).checkpoint_traced is traced, overrides


def test_eager_blocks_are_checkpointed_by_shardtune_on_every_transformers_release() -> None:
    # transformers' own per-block checkpointing wraps `__call__` (hooks inside the checkpoint) up to 5.18 and
    # `forward` after: shardtune's CheckpointedForward is the one mechanism, compiled or not
    from shardtune.parallel.prepare import CheckpointedForward

    def run(ac: str):
        model, blocks, _ = offload_test_model([f"parallel.activation_checkpointing={ac}"])
        calls = []
        for block in blocks:
            block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # the recompute stops early
        ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return model, blocks, len(calls), {n: p.grad for n, p in model.named_parameters()}

    model, blocks, calls, grads = run("full")
    plain = run("none")
    assert all(isinstance(b.forward, CheckpointedForward) for b in blocks)
    assert not getattr(model, "is_activation_checkpointing", model.is_gradient_checkpointing)
    assert calls == 2 * plain[2] == 2 * len(blocks)  # each block's forward ran again in backward
    for name, grad in plain[3].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("where", ["true", "false", "eager"])
def test_a_deep_copy_or_pickle_of_a_prepared_model_trains_its_own_weights(where: str) -> None:
    # each block's checkpointed forward names its block as an attribute: a copy computes with the copy's weights
    # and sends the gradients there (a closure over the original's bound forward had it use the original's)
    import copy
    import pickle

    placed = ["parallel.compile=false"] if where == "eager" else [f"parallel.checkpoint_in_compile={where}",
                                                                   "parallel.compile=true"]
    model, _, _ = offload_test_model(["parallel.activation_checkpointing=full", *placed])
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # compiled once before copying
    model.zero_grad(set_to_none=True)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            for p in copied.parameters():
                p.mul_(0.5)
        halved = {n: p.detach().clone() for n, p in copied.named_parameters()}
        fresh, _, _ = offload_test_model(["parallel.activation_checkpointing=none"])
        fresh.load_state_dict(halved, strict=False)
        loss = copied(input_ids=ids, labels=ids).loss
        loss.backward()
        assert float(loss) == pytest.approx(float(fresh(input_ids=ids, labels=ids).loss), rel=1e-5)
        assert all(p.grad is not None for p in copied.parameters() if p.requires_grad)
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("inside", ["true", "false"])
def test_one_graph_serves_every_block_when_the_embedding_is_frozen(inside: str) -> None:
    """LoRA / QLoRA freeze the input embedding, so the first block's input came without grad and every other's with:
    Dynamo compiled the block twice (call 119: the second graph's compile in the 8B's first step). prepare has the
    embedding's output require grad: one graph for all blocks, and the same losses and block gradients."""
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    overrides = ["parallel.activation_checkpointing=full", "parallel.compile=true",
                 f"parallel.checkpoint_in_compile={inside}"]
    results, models = [], []
    for hook in (True, False):
        torch._dynamo.reset()
        counters.clear()
        model, _, _ = offload_test_model(overrides)
        model.get_input_embeddings().weight.requires_grad_(False)
        models.append(model)
        if not hook:  # the hook prepare registered, dropped: the reference
            model.get_input_embeddings()._forward_hooks.clear()
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        results.append((losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        counters["stats"]["unique_graphs"]))
    (losses, grads, graphs), (ref_losses, ref_grads, ref_graphs) = results
    assert (graphs, ref_graphs) == (1, 2)
    assert losses == ref_losses and grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)
    embed = models[0].get_input_embeddings()
    assert embed(ids).requires_grad
    with torch.no_grad():  # evaluation: the output stays without grad
        assert not embed(ids).requires_grad
