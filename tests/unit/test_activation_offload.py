"""parallel.activation_offload: the decoder's saved tensors go to host memory in power-of-two pieces (on CPU the copy
is to the same memory, so this checks the wiring and what moves, not the bytes freed, which need a GPU): the loss
and gradients of the run without it, every block input moved under full checkpointing and no parameter, the LM
head's tensors left alone; the planner's host term and copy time; the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, offload_test_model, two_steps

from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.models.build import load_hf_config
from shardtune.models.presets import preset_config
from shardtune.parallel import check_combination, checkpoint_traced, describe, prepare
from shardtune.plan import memory as memory_mod
from shardtune.plan.hardware import lookup
from shardtune.plan.memory import GIB, INSIDE_RECOMPUTE, activations, gpu_memory, offloaded_activations
from shardtune.plan.setting import Setting
from shardtune.plan.shape import model_shape
from shardtune.plan.speed import OFFLOAD_EXPOSED, forward_share, offload_seconds, step_time

TINY = str(ROOT / "examples" / "tiny.yaml")


def _model(checkpointing: str, offload: bool):
    return offload_test_model([f"parallel.activation_checkpointing={checkpointing}"], "cpu", offload)


def _recording(pack, moved: list):
    """The offload's pack hook, noting each tensor it moved (its first return value says whether it did)."""
    def recording_pack(tensor):
        packed = pack(tensor)
        if packed[0]:
            moved.append(tensor)
        return packed

    return recording_pack


def _assert_same_training(results: list) -> None:
    """The run with the offload (second) gave the run without its losses and gradients, to the bit."""
    (plain_losses, plain_grads), (losses, grads) = results
    assert losses == plain_losses
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("checkpointing", ["full", "none"])
def test_offload_keeps_the_loss_and_gradients_and_moves_the_block_inputs(checkpointing: str) -> None:
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    results, inputs, moved = [], [], []

    def record_input(_module, args):
        inputs.append(args[0].untyped_storage().data_ptr())

    for offload in (False, True):
        model, blocks, hooks = _model(checkpointing, offload)
        inputs.clear()
        for block in blocks:
            block.register_forward_pre_hook(record_input)
        if hooks is not None:
            hooks.pack_hook = _recording(hooks.pack_hook, moved)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert loss == plain_loss
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved_ptrs = {t.untyped_storage().data_ptr() for t in moved}
    assert not moved_ptrs & params  # the weights a matmul saves stay where they are
    if checkpointing == "full":  # each block's input is what full checkpointing keeps: all of them moved
        assert set(inputs[:len(blocks)]) <= moved_ptrs
    assert hooks.moved_bytes >= len(blocks) * ids.numel() * model.config.hidden_size * 4
    logits = ids.numel() * model.config.vocab_size * 4
    assert all(t.numel() * 4 != logits for t in moved)  # the LM head's output (the logits) is not the decoder's


# around: what checkpoint_in_compile auto takes with the offload (offload_test_model adds the hooks, not the setting)
@pytest.mark.parametrize("where", ["false", "true", "budget"])  # selective under compile: refused
def test_offload_with_compiled_blocks_keeps_their_loss_and_gradients(where: str, without_inductor) -> None:
    """Compiled blocks under full checkpointing, the checkpoint around them (false) or inside them (true), or
    without checkpointing under a memory budget (what the partitioner keeps of each block): the offload hooks see
    the blocks' inputs (and the budget's kept tensors), saved by the checkpoint outside the compiled code or by the
    compiled code itself (AOTAutograd saves its tensors through autograd too); two steps give compile's own losses
    and gradients, and every block input moved. (Traced by Dynamo and AOTAutograd without Inductor's code: the GPU
    test runs the offload with Inductor's.)"""
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    overrides = ["parallel.compile=true"] + (
        ["parallel.activation_checkpointing=none", "parallel.activation_memory_budget=0.3"] if where == "budget" else
        ["parallel.activation_checkpointing=full", f"parallel.checkpoint_in_compile={where}"])
    check_combination(load_config(TINY, [*overrides, "parallel.activation_offload=true"]))
    assert checkpoint_traced(load_config(TINY, overrides).parallel) == (where == "true")
    results, inputs, moved = [], [], []
    for offload in (False, True):
        model, blocks, hooks = offload_test_model(overrides, "cpu", offload)
        for block in blocks:
            block.register_forward_pre_hook(lambda _module, args: inputs.append(args[0].untyped_storage().data_ptr()))
        if hooks is not None:
            hooks.pack_hook = _recording(hooks.pack_hook, moved)
        inputs[:] = []
        results.append(two_steps(model, ids))
    _assert_same_training(results)
    assert set(inputs) <= {t.untyped_storage().data_ptr() for t in moved}  # both steps' block inputs
    inputs_bytes = 2 * len(blocks) * ids.numel() * model.config.hidden_size * 4
    assert hooks.moved_bytes >= inputs_bytes * (2 if where == "budget" else 1)  # more than the inputs are kept


@pytest.mark.parametrize("compiled", [False, True])
def test_offload_under_checkpoint_blocks_moves_the_checkpointed_blocks_only(compiled: bool, without_inductor) -> None:
    """parallel.checkpoint_blocks with the offload: the first N blocks' saved tensors (their inputs) go to the host;
    the blocks left out, whose activations backward reads first, and the final norm keep theirs on the device;
    the loss and gradients of the run without the offload, over two steps (eager, and the checkpoint inside
    compiled blocks, as on the GPU)."""
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    overrides = ["parallel.activation_checkpointing=full", "parallel.checkpoint_blocks=2"] + (
        ["parallel.compile=true", "parallel.checkpoint_in_compile=true"] if compiled else [])
    check_combination(load_config(TINY, [*overrides, "parallel.activation_offload=true"]))
    results, where, moved_at = [], [None], []
    for offload in (False, True):
        model, blocks, hooks = offload_test_model(overrides, "cpu", offload)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda _m, _a, index=index: where.__setitem__(0, index))
        model.model.norm.register_forward_pre_hook(lambda _m, _a: where.__setitem__(0, "norm"))
        if hooks is not None:
            pack = hooks.pack_hook

            def noting_pack(tensor, pack=pack):
                packed = pack(tensor)
                if packed[0]:
                    moved_at.append(where[0])
                return packed

            hooks.pack_hook = noting_pack
        results.append(two_steps(model, ids, lambda: where.__setitem__(0, None)))
    _assert_same_training(results)
    assert {0, 1} <= set(moved_at) <= {None, 0, 1}  # blocks 2-3 (of 4) and the norm: none moved
    assert hooks.moved_bytes >= 2 * 2 * ids.numel() * model.config.hidden_size * 4  # two inputs, two steps


@pytest.mark.parametrize(("blocks", "until"), [(None, None), (3, 3), (4, None), (0, 0)])
def test_the_offload_goes_off_at_the_first_block_left_out_of_the_checkpoint(blocks, until, monkeypatch) -> None:
    """checkpoint_and_compile hands the offload the first block parallel.checkpoint_blocks leaves out (none where
    every block of tiny-llama's 4 is checkpointed)."""
    seen = {}
    real = prepare.offload_activations
    monkeypatch.setattr(prepare, "offload_activations", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    extra = [] if blocks is None else [f"parallel.checkpoint_blocks={blocks}"]
    _, layers, _ = offload_test_model(["parallel.activation_checkpointing=full", "parallel.activation_offload=true",
                                       *extra])
    assert seen["until"] is (None if until is None else layers[until])


def test_small_tensors_and_the_default_threshold_stay() -> None:
    model, blocks, _ = _model("full", False)
    hooks = prepare.offload_activations(model, blocks, "cpu")  # 1 MiB: a tiny model's tensors are all smaller
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert hooks.moved_bytes == 0


def test_copies_back_keep_their_layout() -> None:
    """The copy back has the saved tensor's shape and values; a dense one (contiguous or permuted: a transposed
    operand) its strides too; a broadcast one (stride 0: an attention bias expanded over the heads) is copied
    once and expanded again; one with gaps comes back contiguous at its own size."""
    hooks = prepare.ActivationOffload("cpu", min_bytes=0)
    base = torch.randn(4, 6, 8)
    dense = (base, base.transpose(1, 2), base.permute(2, 0, 1), base[1:].transpose(0, 2),
             torch.randn(4, 1, 8).expand(4, 6, 8), torch.randn(1, 8).expand(5, 8).t())
    gapped = (base[:, ::2], base[:, :1], base[1:, 2:], base[:, :1].expand(4, 6, 8))
    for saved in dense + gapped:
        back = hooks.unpack_hook(hooks.pack_hook(saved))
        assert back.shape == saved.shape, (saved.shape, back.shape)
        torch.testing.assert_close(back, saved, rtol=0, atol=0)
        if any(saved is d for d in dense):
            assert back.stride() == saved.stride(), (saved.shape, saved.stride(), back.stride())
        assert [s == 0 for s in back.stride()] == [s == 0 for s in saved.stride()]
    # a broadcast tensor moves one copy of what it repeats: 4 x 8, 8 and base[:, :1]'s 4 x 8 elements
    expected = 4 * (3 * 192 + 3 * 8 * 6 + 4 * 8 + 8 + 4 * 3 * 8 + 4 * 8 + 3 * 4 * 8 + 4 * 8)
    assert hooks.moved_bytes == expected, (hooks.moved_bytes, expected)


@pytest.mark.parametrize("count, smallest", [(327680 * 4096, 1 << 19), (3 * (1 << 20) + 5, 1 << 18), (100, 256)])
def test_host_copies_are_power_of_two_pieces(count: int, smallest: int) -> None:
    """torch's pinned allocator rounds a request up to a power of two: the pieces add up to the tensor and
    each but a last remainder under `smallest` is a power of two, so nothing is rounded up."""
    pieces = prepare.power_of_two_pieces(count, smallest)
    assert sum(pieces) == count and pieces == sorted(pieces, reverse=True)
    assert all(p & (p - 1) == 0 and p >= smallest for p in pieces[:-1])
    assert pieces[-1] & (pieces[-1] - 1) == 0 or pieces[-1] < smallest


def test_a_moved_tensor_comes_back_whole() -> None:
    """A tensor of 3 MiB + 6 bytes, not contiguous, through the pack and unpack hooks: the same values back,
    stored on the host as 2 MiB + 1 MiB + the 6-byte remainder."""
    hooks = prepare.ActivationOffload("cpu")
    tensor = torch.randn(3 * (1 << 18) + 3, 2, dtype=torch.bfloat16).t()  # 3 MiB + 12 bytes
    moved, (device, shape, dtype, pieces) = hooks.pack_hook(tensor)
    assert moved and [p.numel() * 2 for p in pieces] == [1 << 21, 1 << 20, 12]
    assert hooks.moved_bytes == tensor.numel() * 2
    assert torch.equal(hooks.unpack_hook((moved, (device, shape, dtype, pieces))), tensor)


def test_a_tensor_saved_again_is_copied_once() -> None:
    """Every block saves the same RoPE cos and sin: one host copy while unchanged; changed in place, a new one."""
    hooks = prepare.ActivationOffload("cpu", min_bytes=0)
    tensor = torch.randn(64, 8)
    first, again = hooks.pack_hook(tensor), hooks.pack_hook(tensor)
    assert again[1] is first[1] and hooks.moved_bytes == tensor.numel() * 4
    tensor.mul_(2)
    changed = hooks.pack_hook(tensor)
    assert changed[1] is not first[1] and torch.equal(hooks.unpack_hook(changed), tensor)
    assert torch.equal(hooks.unpack_hook(first), tensor / 2)


@pytest.mark.parametrize("one_gpu", ["auto", "direct"])
def test_a_run_with_offload_trains_as_one_without(cli, tmp_path, one_gpu: str) -> None:
    """The engine wires it in, on one gloo process under FSDP2 and without it (parallel.one_gpu=direct, as the
    benches run micro-batch 3 with the offload on one GPU): the same losses, step for step."""
    losses = []
    for offload in ("false", "true"):
        out = tmp_path / offload
        proc = cli("train", TINY, "train.max_steps=3", "log.every=1", "parallel.activation_checkpointing=full",
                   f"parallel.activation_offload={offload}", f"parallel.one_gpu={one_gpu}", "--nproc", "1",
                   "--output-dir", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        cfg = load_config(TINY, [f"parallel.activation_offload={offload}", f"parallel.one_gpu={one_gpu}"])
        assert ("without FSDP2" in describe(cfg, 1)) is (one_gpu == "direct")  # auto: fp32 keeps FSDP2 either way
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if "loss" in r and not r.get("eval")])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_the_planner_moves_the_block_inputs_to_the_host() -> None:
    shape = model_shape(preset_config("llama-3.1-8b"))
    base = Setting(peft="qlora", activation_checkpointing="full", micro_batch_size=1, seq_len=131072, fused_loss=True)
    on = Setting(**{**base.__dict__, "activation_offload": True})
    inputs = shape.layers * 2 * shape.hidden * 131072  # bf16 block inputs: 32 GiB
    assert offloaded_activations(shape, on) == inputs == 32 * GIB
    plain, moved = gpu_memory(shape, base), gpu_memory(shape, on)
    assert plain.terms["activations"] - moved.terms["activations"] == pytest.approx(inputs)
    final_norm = 6 * shape.hidden * 131072  # its fp32 upcast and bf16 normalised input, on the host with them
    assert moved.host["activations"] == inputs + final_norm and "activations" not in plain.host
    h200 = lookup("h200")
    copies = 2 * inputs / h200.h2d_bytes_per_s  # out in forward, back in backward
    # On the side stream: hidden by the compute but OFFLOAD_EXPOSED of them; what outlasts the compute is exposed.
    assert offload_seconds(shape, on, h200, compute=10 * copies) == pytest.approx(OFFLOAD_EXPOSED * copies)
    assert offload_seconds(shape, on, h200, compute=copies / 2) == pytest.approx((0.5 + OFFLOAD_EXPOSED) * copies)
    assert offload_seconds(shape, base, h200, compute=0.0) == 0.0
    # Priced in the step: the plain run that fits stays faster, so the search does not take the offload for its
    # smaller memory (its tie-break); the difference is the exposed share.
    fast, slow = step_time(shape, base, h200), step_time(shape, on, h200)
    assert slow.seconds - fast.seconds == pytest.approx(OFFLOAD_EXPOSED * copies)


def test_the_planner_moves_the_checkpointed_blocks_inputs_only_under_checkpoint_blocks() -> None:
    """parallel.checkpoint_blocks with the offload (8B LoRA, table 2's micro-batch, compiled, the checkpoint
    inside): the N checkpointed blocks' inputs go to the host, the blocks left out keep their activations on the
    GPU and the final norm its saved tensors, and the copies price N inputs; where the last blocks' backward
    starts (their activations and the N inputs alive: the peak of this Setting's FSDP2 path) the GPU holds the
    same as without the offload less the N inputs."""
    shape = model_shape(preset_config("llama-3-8b"))
    tokens, n = 4096, 28
    plain = Setting(peft="lora", micro_batch_size=2, seq_len=2048, fused_loss=True, compile=True,
                    activation_checkpointing="full", checkpoint_in_compile=True, checkpoint_blocks=n)
    moved = Setting(**{**plain.__dict__, "activation_offload": True})
    every = Setting(**{**moved.__dict__, "checkpoint_blocks": None})
    inputs = n * 2 * shape.hidden * tokens
    assert offloaded_activations(shape, moved) == inputs
    assert offloaded_activations(shape, every) == shape.layers * 2 * shape.hidden * tokens
    assert gpu_memory(shape, moved).host["activations"] == inputs  # the final norm stays on the GPU
    # none checkpointed (N = 0): the hooks go off at the first block, so nothing goes to the host
    assert offloaded_activations(shape, moved.replace(checkpoint_blocks=0)) == 0
    assert gpu_memory(shape, moved.replace(checkpoint_blocks=0)).host["activations"] == 0
    kept, off = gpu_memory(shape, plain), gpu_memory(shape, moved)
    assert kept.phase == off.phase == "backward start"
    assert kept.allocated - off.allocated == pytest.approx(inputs)
    h100 = lookup("h100")
    assert offload_seconds(shape, moved, h100, compute=1.0) == pytest.approx(
        OFFLOAD_EXPOSED * 2 * inputs / h100.h2d_bytes_per_s)


def test_the_planner_prices_the_offload_with_the_checkpoint_inside_or_around() -> None:
    """With compiled blocks and the offload, checkpoint_in_compile auto keeps the checkpoint around (the long
    sequences the offload is for: inside, the recompute's backward holds 3.5 x p x f bytes per token more); true
    puts it inside. The same block inputs go to the host either way."""
    shape = model_shape(preset_config("llama-3.1-8b"))
    tokens = 131072
    around = Setting(peft="qlora", activation_checkpointing="full", micro_batch_size=1, seq_len=tokens,
                     fused_loss=True, compile=True, activation_offload=True)
    inside = Setting(**{**around.__dict__, "checkpoint_in_compile": True})
    assert not around.checkpoint_traced and inside.checkpoint_traced
    assert offloaded_activations(shape, inside) == offloaded_activations(shape, around)
    more = gpu_memory(shape, inside).allocated - gpu_memory(shape, around).allocated
    assert more == pytest.approx(INSIDE_RECOMPUTE * 2 * shape.ffn * tokens, rel=1e-6)


def test_the_planner_brings_a_blocks_offloaded_activations_back_in_backward() -> None:
    """Without checkpointing (compiled blocks under a memory budget) the offload moves what the budget keeps; in
    backward each block's comes back beside what it recomputes, with the next block's copied back ahead (up to
    BACK_BYTES and one more tensor, the MLP's tokens x f, where a block holds more): the GPU's share at the
    backward's end. Under full checkpointing the terms stay those the rows were fitted on."""
    shape = model_shape(preset_config("llama-3-8b"))
    kept = Setting(peft="lora", micro_batch_size=2, seq_len=2048, fused_loss=True, compile=True,
                   activation_checkpointing="none", memory_budget=0.3)
    moved = Setting(**{**kept.__dict__, "activation_offload": True})
    saved, recompute = activations(shape, kept)
    assert offloaded_activations(shape, moved) == saved
    assert memory_mod.OFFLOAD_BACK_BYTES == prepare.BACK_BYTES
    back = gpu_memory(shape, moved)
    assert back.phase == "backward end"
    assert back.terms["activations"] == pytest.approx(recompute + 2 * saved / shape.layers)
    long = Setting(**{**moved.__dict__, "micro_batch_size": 1, "seq_len": 131072})
    block = offloaded_activations(shape, long) / shape.layers
    bound = prepare.BACK_BYTES + 131072 * shape.ffn * 2
    assert block > bound
    assert memory_mod.offload_returned(shape, long) == pytest.approx(block + bound)
    assert gpu_memory(shape, kept).allocated - back.allocated > 3 * GIB  # 4.4 GiB of kept tensors on the host
    full = Setting(**{**moved.__dict__, "activation_checkpointing": "full", "memory_budget": None})
    assert memory_mod.offload_returned(shape, full) == 0.0
    # the copies out run beside the forward only: past it they are exposed, though the step's compute is longer
    h100 = lookup("h100")
    one_way = saved / h100.h2d_bytes_per_s
    compute = 0.9 * one_way / forward_share(shape, moved)  # the forward 0.9 of the copies out; the rest 1.3 back
    assert offload_seconds(shape, moved, h100, compute) == pytest.approx((0.1 + 2 * OFFLOAD_EXPOSED) * one_way)


def test_offload_is_refused_where_it_does_not_run() -> None:
    # DeepSpeed casts the model to the compute dtype (no autocast): its ddp (stage 0) offloads no weight copies.
    for strategy in ("ddp", "zero3"):
        check_combination(load_config(TINY, ["parallel.backend=deepspeed", f"parallel.strategy={strategy}",
                                             "parallel.activation_offload=true"]))
    check_combination(load_config(TINY, ["parallel.compile=true", "parallel.activation_offload=true",
                                         "parallel.activation_checkpointing=full"]))
    with pytest.raises(ShardtuneError, match=r"set parallel\.strategy=zero2 or zero3"):
        check_combination(load_config(TINY, ["parallel.strategy=ddp", "parallel.activation_offload=true"]))


def test_plan_says_where_the_activations_are(cli) -> None:
    proc = cli("plan", TINY, "parallel.activation_checkpointing=full", "parallel.activation_offload=true", "--gpu",
               "h100")
    assert proc.returncode == 0 and "checkpointing full, saved activations in host memory" in proc.stdout


def _long_plan(seq: int, host_gib: int, *overrides: str):
    from dataclasses import replace

    from shardtune.plan import make_plan

    cfg = load_config(str(ROOT / "bench" / "bench.yaml"), [
        "data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3.1-8b", f"train.seq_len={seq}",
        f"model.max_position_embeddings={max(seq, 131072)}", "peft.method=qlora", "model.liger=loss",
        "parallel.strategy=auto", "train.micro_batch_size=auto", *overrides])
    hw = replace(lookup("h200"), host_memory_bytes=host_gib * GIB)
    return cfg, make_plan(cfg, load_hf_config(cfg.model), hw, world=1, per_node=1)


def test_the_search_moves_activations_to_the_host_where_nothing_else_fits() -> None:
    """8B QLoRA at 327,680 tokens on one H200 (what ran, bench/RESULTS.md 2026-12-04): only full checkpointing
    with the block inputs on the host fits, and `strategy: auto` finds it; at 131,072 tokens the GPU holds them
    and the copies would cost time, so it does not. Set off in the config, nothing fits at 327,680 (the refusal
    names the offload), and at 262,144 only the MLPs in tiles do (parallel.tiled_mlp: the block inputs on the GPU),
    as with too little host memory for the offload."""
    from shardtune.plan import auto_overrides, config_for_auto, refusal

    cfg, plan = _long_plan(327680, 128)
    assert plan.pick is not None and plan.pick.setting.activation_offload
    assert plan.pick.setting.activation_checkpointing == "full" and plan.pick.setting.micro_batch_size == 1
    assert "parallel.activation_offload=true" in auto_overrides(config_for_auto(cfg, plan.pick.setting, plan.auto),
                                                                plan.auto)
    assert not _long_plan(131072, 128)[1].pick.setting.activation_offload
    _, without = _long_plan(327680, 128, "parallel.activation_offload=false")
    assert without.pick is None and "parallel.activation_offload=true fits" in refusal(without)
    kept = _long_plan(262144, 128, "parallel.activation_offload=false")[1].pick  # the block inputs on the GPU:
    assert kept is not None and kept.setting.mlp_tiled and not kept.setting.activation_offload  # with the MLP's tiles
    _, compiled = _long_plan(327680, 128, "parallel.compile=true")  # offload goes with compile under checkpointing
    assert compiled.pick is not None and compiled.pick.setting.activation_offload and compiled.pick.setting.compile
    assert compiled.pick.setting.activation_checkpointing == "full"
    assert "fsdp2/zero2/none/activation_offload" not in compiled.to_json()["refused"]  # refused only without it
    small = _long_plan(262144, 64)[1].pick  # the offload's 64 GiB of pinned host memory do not fit: the tiles do
    assert small is not None and small.setting.mlp_tiled and not small.setting.activation_offload


def test_a_frozen_embeddings_output_is_not_held_beside_its_copy_on_the_host(without_inductor) -> None:
    """prepare.one_graph_for_every_block: a frozen embedding's output requires grad (so the first block's input
    is as every other's: one compiled graph for all) without being a leaf. As a leaf its AccumulateGrad node held
    it until backward, beside the offload's copy of it on the host (32 MiB on the 8B shape at 4,096 tokens, 2.5
    GiB at 327,680: call 142's probe), and gave it a `.grad` at backward's end. The graphs of the run whose
    embedding trains; the blocks' gradients of the run without the offload, to the bit."""
    import weakref

    from torch._dynamo.utils import counters

    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    overrides = ["parallel.activation_checkpointing=full", "parallel.compile=true",
                 "parallel.checkpoint_in_compile=true"]
    grads, graphs = [], []
    for offload, frozen in ((False, True), (True, True), (True, False)):
        torch._dynamo.reset()
        counters.clear()
        model, _, _ = offload_test_model(overrides, "cpu", offload)
        embed = model.get_input_embeddings()
        embed.weight.requires_grad_(not frozen)
        made, given = [], []  # the lookup's output, and what the blocks get
        embed.register_forward_hook(lambda _m, _a, out, made=made: made.append(weakref.ref(out)), prepend=True)
        embed.register_forward_hook(lambda _m, _a, out, given=given: given.append(weakref.ref(out)))
        loss = model(input_ids=ids, labels=ids).loss
        if offload and frozen:
            assert made[0]() is None and given[0]() is None  # only the host copy is left
        assert given[0]() is None or given[0]().requires_grad
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None and "embed" not in n})
    assert graphs[1] == graphs[2] > 0
    assert grads[1].keys() == grads[0].keys() and grads[1]
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], rtol=0, atol=0, msg=name)
