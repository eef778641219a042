"""GPU checks: run on the GPU machine; skipped cleanly without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, offload_test_model, shardtune

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _step_records(out) -> list[dict]:
    """A run's metrics.jsonl records of training steps (evaluations left out)."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]


def _tiny_run(out, *overrides: str) -> tuple[list[float], str]:
    """examples/tiny.yaml trained on one GPU with `overrides`, logging every step: (its losses, its stderr)."""
    proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                     "log.every=1", *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [r["loss"] for r in _step_records(out) if "loss" in r], proc.stderr


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_bf16_training_on_all_gpus(tmp_path, strategy):
    out = tmp_path / strategy
    proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "auto", "--output-dir", str(out),
                     f"parallel.strategy={strategy}", "train.precision=bf16", "train.max_steps=20", "log.every=5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = _step_records(out)
    assert "x cuda" in proc.stderr
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["mfu"] is not None and steps[-1]["peak_mem_gib"] > 0


def test_each_record_holds_its_intervals_own_peak():
    """metrics.jsonl's peak_mem_gib is the interval's own on a GPU: the counters start again at each record, so a
    1 GiB tensor freed in one interval is not the next one's peak."""
    from shardtune.train.loop import _peak_memory_gib

    device = torch.device("cuda")
    _peak_memory_gib(device)
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    del big
    first = _peak_memory_gib(device)[0]
    small = torch.empty(2**20, dtype=torch.uint8, device=device)
    del small
    second = _peak_memory_gib(device)[0]
    assert first - second == pytest.approx(1.0, abs=0.01)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_profiled_steps_give_the_collectives_achieved_bus_bandwidth(tmp_path):
    """log.profile on 2 GPUs (zero3): the NCCL kernels of the profiled steps and the comm counter's bytes give each
    collective's bus bandwidth, in summary.json, metrics.jsonl and the profile's table."""
    out = tmp_path / "run"
    proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "2", "--output-dir", str(out),
                     "parallel.strategy=zero3", "train.precision=bf16", "train.max_steps=12", "log.every=2",
                     "log.profile={start: 5, steps: 2}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    profiled = json.loads((out / "summary.json").read_text())["comm"]["profiled"]
    for kind in ("all_gather", "reduce_scatter"):
        row = profiled[kind]
        assert row["kernels_per_step"] >= 1 and row["kernel_ms_per_step"] > 0
        assert 1e6 < row["bus_bytes_per_s"] < 2e12  # between 1 MB/s and past NVLink's peak: a rate, not garbage
    records = _step_records(out)
    logged = [r for r in records if "comm_all_gather_bus_gbps" in r]
    assert len(logged) == 1 and logged[0]["step"] == 8  # the first record after the profiled steps 5-6, once
    assert "bus GB/s" in (out / "profile" / "rank0.txt").read_text()


def test_host_copy_reads_its_values_without_waiting_for_later_work():
    """dist.HostCopy (the one-GPU step's skip flag): the values when taken, read while later kernels still run."""
    from shardtune.dist import HostCopy

    dev = torch.device("cuda")
    t = torch.full((), 2.5, device=dev)
    read = HostCopy(t, torch.isfinite(t))
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(50):  # queued after the copy
        big = big @ big / 64
    t.add_(1.0)
    assert read.values() == [2.5, 1.0]
    torch.cuda.synchronize()


def test_a_batch_reaches_the_gpu_without_the_host_waiting_for_queued_kernels():
    """data.to_device (each micro-batch of the loop): the copy queues behind the GPU's work and the host goes on,
    so the queue never drains at a micro-batch's start; the values arrive."""
    from shardtune.data import Batch, to_device

    ids = torch.arange(4 * 2048).reshape(4, 2048)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    to_device(batch, torch.device("cuda"))  # the pinned blocks, allocated once (an allocation may synchronize)
    torch.cuda.synchronize()  # their copies done: the allocator hands the same blocks out again
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the copy
    busy = torch.cuda.Event()
    busy.record()
    moved = to_device(batch, torch.device("cuda"))
    assert not busy.query()  # the host is back while the GPU still sleeps
    assert moved.input_ids.is_cuda and moved.input_ids.cpu().equal(ids)


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_direct_trains_peft_as_fsdp2_on_one_gpu(tmp_path, peft):
    """parallel.one_gpu: direct (LoRA's matrices cast in their forward, clipping inside fused AdamW) against FSDP2
    on a mesh of one, bf16 on the GPU: the same losses to bf16's rounding over 20 steps. At lr 3e-3: at 1e-2 the
    tiny LoRA run spikes (grad norm 3.9 at step 12) and amplifies the two paths' rounding (dividing the gradients
    by the clip's factor in the kernel against multiplying them first) to 1.5% by step 20 on CPU and 7% on an
    H200 (2026-12-04); at 3e-3 CPU keeps them within 1.4e-4 over the 20 steps."""
    losses = {mode: _tiny_run(tmp_path / mode, f"peft.method={peft}", "train.precision=bf16", "train.max_steps=20",
                              "parallel.strategy=zero2", f"parallel.one_gpu={mode}", "train.lr=0.003")[0]
              for mode in ("fsdp2", "direct")}
    assert len(losses["direct"]) == len(losses["fsdp2"]) == 20
    assert losses["direct"][-1] < losses["direct"][0]
    for a, b in zip(losses["direct"], losses["fsdp2"], strict=True):
        assert a == pytest.approx(b, rel=2e-2)


def test_liger_backward_without_the_sync_gives_liger_s_gradients_bit_for_bit():
    """The fused loss's backward with Liger's own helper and with shardtune's (no host sync), bf16 on the GPU, the
    loss scaled as shardtune scales it: the same hidden-state and head gradients, bit for bit."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    from shardtune.models.liger import REPLACED, backward_without_sync, liger_loss

    torch.manual_seed(0)
    hidden = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16) / 16
    targets = torch.randint(0, 4096, (1024,), device="cuda")
    targets[::7] = -100
    grads = {}
    loss_fn = liger_loss(0)  # puts the sync-free helper in place
    swapped = flce.fused_linear_cross_entropy_backward
    assert swapped is backward_without_sync and len(REPLACED) == 1
    original = REPLACED[0]
    for name, helper in (("liger", original), ("shardtune", swapped)):
        flce.fused_linear_cross_entropy_backward = helper
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (loss_fn(w, h, targets) / 877.0 * 2).backward()
        grads[name] = (h.grad, w.grad)
    flce.fused_linear_cross_entropy_backward = swapped
    for a, b in zip(grads["liger"], grads["shardtune"], strict=True):
        assert torch.equal(a, b)
    assert grads["liger"][0].abs().max() > 0


def test_the_head_gradient_summed_in_the_weights_dtype_peaks_lower_to_bf16_rounding():
    """model.liger_accum: weight (the default: Liger's accum_dtype None, what HF Trainer + Liger runs) against fp32,
    at the 1B shape's head (128,256 x 2,048, bf16) and 8,192 tokens in 1,024-token chunks: the same loss, the
    head's gradient to bf16 rounding of eight sums, and a lower peak in the forward: Liger 0.8.5 casts the fp32
    sum to bf16 after the last chunk, both alive (6 bytes a head weight), where the bf16 sum peaks at 2 bytes and a
    chunk's logits (plan/memory.py fused_loss_bytes; call 98 found the bytes held after the forward equal)."""
    pytest.importorskip("liger_kernel")
    from shardtune.models.liger import liger_loss

    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden, tokens, chunk = 128256, 2048, 8192, 1024
    hidden_states = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    weight0 = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    out = {}
    for accum in ("fp32", "weight"):
        weight = weight0.clone().requires_grad_(True)
        x = hidden_states.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = liger_loss(chunk, accum)(weight, x, targets)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        loss.backward()
        out[accum] = (loss.item(), weight.grad.float(), x.grad.float(), peak)
        del weight, x, loss
    assert out["weight"][0] == out["fp32"][0]  # the forward's loss does not depend on the accumulator
    torch.testing.assert_close(out["weight"][2], out["fp32"][2], rtol=0, atol=0)  # nor the input's gradient
    grad, ref = out["weight"][1], out["fp32"][1]
    assert grad.dtype == ref.dtype and not torch.equal(grad, ref)  # it did sum in bf16
    assert (grad - ref).abs().max() <= 8 * 2**-8 * ref.abs().max()  # eight bf16 roundings at most
    assert out["fp32"][3] - out["weight"][3] == pytest.approx(4 * vocab * hidden - chunk * vocab * 2, rel=0.1)


def test_the_default_takes_liger_where_it_is_installed(tmp_path):
    """model.liger defaults to auto: on a GPU with liger-kernel, a plain config gets Liger's kernels and fused loss
    (no compile), says so, and trains like model.liger=false to bf16's rounding of other kernels."""
    pytest.importorskip("liger_kernel")
    losses, logs = {}, {}
    for name, extra in (("auto", []), ("off", ["model.liger=false"])):
        out = tmp_path / name
        proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                         "train.precision=bf16", "train.max_steps=20", "log.every=1", *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = _step_records(out)
        losses[name], logs[name] = [r["loss"] for r in records if "loss" in r], proc.stderr
    assert "liger: RMSNorm, RoPE, SwiGLU kernels, fused linear + cross-entropy loss" in logs["auto"]
    assert "liger:" not in logs["off"]
    assert losses["auto"][0] == pytest.approx(losses["off"][0], rel=0.01)
    assert sum(losses["auto"][-5:]) / 5 == pytest.approx(sum(losses["off"][-5:]) / 5, rel=0.05)


def test_float8_trains_like_bf16_on_the_gpu(tmp_path):
    """train.float8 on the GPU (torch._scaled_mm's float8 kernels, compute capability 8.9+), both recipes against
    bf16 on the tiny model: the same losses to float8's rounding over 20 steps, falling, and a plain export."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+")
    losses = {}
    for mode in ("false", "tensorwise", "rowwise"):
        out = tmp_path / mode
        proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                         "train.precision=bf16", f"train.float8={mode}", "train.max_steps=20", "log.every=1",
                         "train.lr=0.003")
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = _step_records(out)
        losses[mode] = [r["loss"] for r in records if "loss" in r]
    assert "float8 (rowwise)" in proc.stderr
    for mode in ("tensorwise", "rowwise"):
        assert len(losses[mode]) == 20 and losses[mode][-1] < losses[mode][0]
        assert losses[mode] != losses["false"]  # it did run in float8
        # The first step (the same weights) differs by float8's rounding only; later the tiny model's 20-step
        # trajectory amplifies it (8% at one step on an H200, 2026-12-04), so its tail is checked looser.
        assert losses[mode][0] == pytest.approx(losses["false"][0], rel=0.02)
        tail, want = sum(losses[mode][-5:]) / 5, sum(losses["false"][-5:]) / 5
        assert tail == pytest.approx(want, rel=0.1)
    assert (tmp_path / "rowwise" / "model" / "model.safetensors").exists()


def test_a_float8_lora_base_cast_once_gives_the_per_step_casts_losses(tmp_path):
    """peft.base_dtype=float8 (LoRA's frozen float8 layers cast once, bf16 copies freed; what auto takes with
    float8 since the twenty-fifth session) against bf16 (the base cast every step), compiled blocks on the GPU: the
    same losses (the same casts), and the freed bytes logged."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+")
    losses = {}
    for mode in ("bf16", "float8"):  # not auto: it is float8 here, and the test would compare a run with itself
        out = tmp_path / mode
        proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                         "train.precision=bf16", "train.float8=tensorwise", "peft.method=lora",
                         f"peft.base_dtype={mode}", "parallel.compile=true", "train.max_steps=10", "log.every=1")
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = _step_records(out)
        losses[mode] = [r["loss"] for r in records if "loss" in r]
    assert "float8 base: " in proc.stderr and "frozen layers kept as their float8 casts (" in proc.stderr  # GiB freed
    assert len(losses["float8"]) == 10
    for a, b in zip(losses["bf16"], losses["float8"], strict=True):
        assert b == pytest.approx(a, rel=1e-3)


def test_activation_offload_copies_out_without_the_host_waiting():
    """parallel.activation_offload on a GPU: the copy out runs on a side stream behind the kernel that made the
    tensor, so the host is back while the GPU still works (save_on_cpu's copy would wait for it). Each ordering
    the side stream needs is forced with sleeps, so that leaving one out gives wrong values: (a) the copy out
    waits for the tensor's kernel, queued behind a sleep on the compute stream; (b) the tensor's memory is not
    reused while its copy is queued: the copy is held back by a sleep on the side stream while the compute stream
    allocates and fills a tensor of its size; (c) the compute stream waits for the copy back, held back the same
    way."""
    from shardtune.parallel.prepare import ActivationOffload

    hooks = ActivationOffload("cuda", min_bytes=0)
    shape = (3 * (1 << 18) + 3, 2)  # 6 MiB + 24 bytes: pieces of 4 MiB, 2 MiB and the rest
    # the pinned blocks allocated once, and every kernel below loaded once (either may synchronize)
    hooks.pack_hook(torch.zeros(shape, device="cuda"))
    hooks.unpack_hook(hooks.pack_hook(torch.zeros(shape, device="cuda") * 1.0)) * 1.0
    torch.full(shape, -1.0, device="cuda")
    torch.cuda.synchronize()
    hooks.copies.clear()
    hooks.settle()
    side = next(iter(hooks.streams.values()))
    src_a, src_b = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
    want_a, want_b = src_a.cpu(), src_b.cpu()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time queued on the compute stream
    busy = torch.cuda.Event()
    busy.record()
    packed_a = hooks.pack_hook(src_a * 1.0)  # (a) made after the sleep
    assert not busy.query()  # the host is back while the GPU still sleeps
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # (b) the next copy out runs ~1 s after its tensor is made
    made_b = src_b * 1.0
    packed_b = hooks.pack_hook(made_b)
    del made_b
    clobber = torch.full(shape, -1.0, device="cuda")  # would take made_b's block were it not held
    hooks.settle()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # (c) the copies back run late
    back_b = hooks.unpack_hook(packed_b) * 1.0  # used on the compute stream at once
    back_a = hooks.unpack_hook(packed_a) * 1.0
    assert torch.equal(back_a.cpu(), want_a) and torch.equal(back_b.cpu(), want_b)
    assert bool((clobber == -1.0).all()) and not hooks.in_flight


@pytest.mark.parametrize("bound, waits", [(1 << 40, False), (0, True)])
def test_activation_offload_bounds_the_copies_back_the_host_queues(monkeypatch, bound, waits):
    """The copies back hold side-stream memory until the GPU is past their use: past BACK_BYTES of them the host
    waits for the GPU to reach the oldest one's unpack, and under it goes on."""
    from shardtune.parallel import prepare

    monkeypatch.setattr(prepare, "BACK_BYTES", bound)
    hooks = prepare.ActivationOffload("cuda", min_bytes=0)
    shape = (1 << 20,)
    packed = [hooks.pack_hook(torch.randn(shape, device="cuda")) for _ in range(2)]
    hooks.unpack_hook(hooks.pack_hook(torch.randn(shape, device="cuda")))  # pinned blocks and kernels loaded
    hooks.settle()
    torch.cuda.synchronize()
    hooks.coming_back.clear()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s queued on the compute stream
    busy = torch.cuda.Event()
    busy.record()
    back = [hooks.unpack_hook(p) for p in packed]  # the second waits for the first's unpack point, or not
    assert busy.query() is waits
    assert len(hooks.coming_back) == (1 if waits else 2)
    torch.cuda.synchronize()
    assert all(b.shape == shape for b in back)


@pytest.mark.parametrize("checkpointing, compiled, inside", [("full", False, "auto"), ("none", False, "auto"),
                                                              ("full", True, "true"), ("full", True, "false"),
                                                              ("none", True, "auto"), ("cb2", False, "auto"),
                                                              ("cb2", True, "true")])
def test_activation_offload_on_the_gpu_keeps_the_loss_and_gradients(checkpointing, compiled, inside):
    """The tiny model in fp32 on the GPU, every saved tensor through the side-stream copies: the loss and
    gradients of the run without offload (compiled blocks: of the compiled run without offload), the checkpoint
    inside the compiled blocks (the hooks take what the compiled code saves; what this case ran before the
    parameter, offload_test_model's config leaving the offload out: passed in call 96) or around them, or none
    under a memory budget of 0.3 (the hooks take what the budget keeps; forty-second session); cb2: the first 2
    of the 4 blocks checkpointed (parallel.checkpoint_blocks), the hooks off from the third (forty-fifth)."""
    overrides = [f"parallel.compile={str(compiled).lower()}", f"parallel.checkpoint_in_compile={inside}"]
    overrides += (["parallel.activation_checkpointing=full", "parallel.checkpoint_blocks=2"] if checkpointing == "cb2"
                  else [f"parallel.activation_checkpointing={checkpointing}"])
    if compiled and checkpointing == "none":
        overrides.append("parallel.activation_memory_budget=0.3")
    ids = torch.randint(0, 250, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for offload in (False, True):
        model, blocks, hooks = offload_test_model(overrides, "cuda", offload)
        for block in blocks if not compiled else []:  # the compute stream behind the host, as in a real step
            block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(20_000_000))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert hooks.moved_bytes > 0
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in grads.items():  # fp32; the attention backward may add in another order from run to run
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_tiled_mlp_on_the_gpu_keeps_the_loss_and_gradients_and_lowers_the_peak(compiled):
    """parallel.tiled_mlp on the GPU (flash attention, Inductor's code around the eager tiles, the activation offload's
    side-stream copies): the tiny model in fp32, full checkpointing, 4 x 512 tokens in 256-token tiles against the
    run without tiles (compiled: the checkpoint around the blocks in both, as the tiles take it): the same loss, the
    gradients to the attention backward's run-to-run order (compiled: to the tolerance of eager tiles against
    Inductor's fused MLP), and a lower peak of allocated memory in backward compiled (the recomputed block's MLP
    tensors are a tile's; passed on an H100, call 146). Eager, this model's peak lies outside the MLP at this size:
    equal to the byte with and without tiles (call 146), so there it must not rise (CPU, larger MLPs:
    tests/unit/test_tiled_mlp.py; 8B QLoRA at 327,680 tokens: 51.2 GiB tiled, where untiled does not fit an
    H100)."""
    base = ["parallel.activation_checkpointing=full", f"parallel.compile={str(compiled).lower()}"]
    base += ["parallel.checkpoint_in_compile=false"] if compiled else []
    ids = torch.randint(0, 250, (4, 512), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for tiles in ([], ["parallel.tiled_mlp=256"]):
        model, _, hooks = offload_test_model([*base, *tiles], "cuda", True)
        for _ in range(2):  # the first compiles
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        results.append((float(loss), peak, {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert hooks.moved_bytes > 0
    (plain_loss, plain_peak, plain_grads), (loss, peak, grads) = results
    assert loss == pytest.approx(plain_loss, rel=1e-5 if compiled else 1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-3 if compiled else 1e-4, atol=1e-5 if compiled
                                   else 1e-6, msg=name)
    assert peak < plain_peak if compiled else peak <= plain_peak, (peak, plain_peak)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_deepspeed_with_the_long_sequence_settings_trains_as_without_on_the_gpu(tmp_path, strategy):
    """parallel.activation_offload (side-stream copies beside DeepSpeed's own streams) and parallel.tiled_mlp on the
    DeepSpeed backend, bf16 on one GPU: the same losses as the run without them to bf16's rounding over 12 steps
    (CPU, fp32, 2 processes: to 1e-7, tests/dist/test_deepspeed.py). Packed rows of 4,096 tokens: each block's input
    (2 MiB) is over the offload's 1 MiB floor; tiles of 1,024 tokens."""
    base = ["parallel.backend=deepspeed", f"parallel.strategy={strategy}", "train.precision=bf16",
            "parallel.activation_checkpointing=full", "train.max_steps=12", "train.lr=0.003", "data.packing=true",
            "train.seq_len=4096", "train.micro_batch_size=2"]
    long = ["parallel.activation_offload=true", "parallel.tiled_mlp=1024"]
    losses = {"plain": _tiny_run(tmp_path / "plain", *base)[0], "long": _tiny_run(tmp_path / "long", *base, *long)[0]}
    assert len(losses["long"]) == len(losses["plain"]) == 12
    assert losses["long"][-1] < losses["long"][0]
    for a, b in zip(losses["long"], losses["plain"], strict=True):
        assert a == pytest.approx(b, rel=2e-2)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_deepspeed_trains_with_liger_s_fused_loss_as_with_the_plain_one(tmp_path, strategy):
    """model.liger: loss on the DeepSpeed backend (stages 0-2 since the forty-eighth session, ZeRO-3 with the LM
    head gathered for the loss's module since the forty-ninth; on CPU with the loss's plain-torch contract,
    tests/dist/test_deepspeed.py): Liger's kernel, which computes the head's gradient in its forward, gives the
    plain loss's losses to bf16's rounding over 12 steps, and the run says it took it."""
    base = ["parallel.backend=deepspeed", f"parallel.strategy={strategy}", "train.precision=bf16",
            "train.max_steps=12", "train.lr=0.003"]
    plain, _ = _tiny_run(tmp_path / "plain", *base, "model.liger=false")
    fused, said = _tiny_run(tmp_path / "fused", *base, "model.liger=loss")
    assert "liger: fused linear + cross-entropy loss" in said
    assert len(fused) == len(plain) == 12 and fused[-1] < fused[0]
    for a, b in zip(fused, plain, strict=True):
        assert a == pytest.approx(b, rel=2e-2)


def test_a_memory_budget_holds_less_after_the_forward_with_the_same_gradients_on_the_gpu():
    """parallel.activation_memory_budget on the GPU (Triton kernels, flash attention): the tiny model in fp32,
    compiled blocks; what the forward leaves allocated (the saved activations) falls with the budget, and the loss
    and gradients are those of no budget."""
    import torch._functorch.config as functorch_config

    ids = torch.randint(0, 250, (8, 512), generator=torch.Generator().manual_seed(1)).cuda()
    results = {}
    with functorch_config.patch(activation_memory_budget=1.0):
        for budget in (None, 0.5, 0.0):
            extra = [] if budget is None else [f"parallel.activation_memory_budget={budget}"]
            model, _, _ = offload_test_model(["parallel.compile=true", *extra], "cuda")
            for _ in range(2):  # the first compiles
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                loss = model(input_ids=ids, labels=ids).loss
                held = torch.cuda.memory_allocated() - before
                loss.backward()
            results[budget] = (float(loss), held, {n: p.grad.clone() for n, p in model.named_parameters()})
    (plain_loss, plain_held, plain_grads) = results[None]
    assert results[0.0][1] < results[0.5][1] < plain_held, {b: r[1] for b, r in results.items()}
    for budget in (0.5, 0.0):
        loss, _, grads = results[budget]
        assert loss == pytest.approx(plain_loss, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_compiled_update_trains_as_fused_adamw_on_the_gpu(tmp_path):
    """optim.fused: compiled on the direct path (bf16, one micro-batch: the update reads the bf16 gradients) against
    torch's fused AdamW, 20 steps of tiny-llama: the same losses to bf16's rounding (CPU: 1e-5 over 4 steps; the two
    updates' fp32 rounding turns a bf16 weight one unit the other way now and then)."""
    losses = {}
    for fused in ("true", "compiled"):
        out = tmp_path / fused
        proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                         "train.precision=bf16", "train.max_steps=20", "log.every=1", "train.grad_accum=1",
                         "parallel.strategy=zero2", "parallel.one_gpu=direct", f"optim.fused={fused}",
                         "train.lr=0.003")
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[fused] = [r["loss"] for r in records if "loss" in r and not r.get("eval")]
    assert len(losses["compiled"]) == len(losses["true"]) == 20
    assert losses["compiled"][0] == pytest.approx(losses["true"][0], rel=1e-6)
    # the bound of test_direct_trains_peft_as_fsdp2_on_one_gpu, two rounding orders of one update at this lr
    assert max(abs(a / b - 1) for a, b in zip(losses["compiled"], losses["true"], strict=True)) < 2e-2, losses
    assert losses["compiled"][-1] < losses["compiled"][0]


def test_the_host_embedding_lookup_does_not_wait_for_the_gpu():
    """peft.offload_embedding: handed the host's ids, the lookup gathers on the host into pinned memory and queues
    the copy behind the GPU's work: the host is back while the GPU still sleeps, and the rows arrive."""
    from torch import nn

    from shardtune.parallel.host_embedding import HostEmbedding

    table = nn.Embedding(1000, 64).requires_grad_(False)
    host = HostEmbedding(table, torch.device("cuda"))
    ids = torch.randint(0, 1000, (2, 128))
    host.ids = ids
    host(ids.cuda())  # the pinned blocks, allocated once (an allocation may synchronize)
    gpu_ids = ids.cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead
    busy = torch.cuda.Event()
    busy.record()
    host.ids = ids
    rows = host(gpu_ids)
    assert not busy.query() and host.waited == 0
    assert rows.is_cuda and torch.equal(rows.cpu(), table(ids))
    with pytest.warns(UserWarning, match="without the batch's host copy"):  # no host ids: it waits, and says so
        again = host(gpu_ids)
    assert host.waited == 1 and torch.equal(again, rows)


def test_lora_takes_the_host_embedding_by_default_on_a_gpu_and_trains_as_with_it_on_the_gpu(tmp_path):
    """peft.offload_embedding: auto (the default since call 103): LoRA on a GPU with an untied embedding plans and
    runs it on the host, with the losses of the table on the GPU (the same rows; the lookup's order is the only
    difference, none in bf16 copies); set false, the plan keeps it on the GPU."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "untied"
    assert shardtune("init-model", str(folder), "--preset", "tiny-llama", "--seed", "1").returncode == 0
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].flip(0).clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    losses, logs = {}, {}
    for name, extra in (("auto", []), ("gpu", ["peft.offload_embedding=false"])):
        out = tmp_path / name
        proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "1", "--output-dir", str(out),
                         f"model.path={folder}", "model.preset=null", "peft.method=lora", "train.precision=bf16",
                         "train.max_steps=10", "log.every=1", "train.lr=0.003", *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = _step_records(out)
        losses[name], logs[name] = [r["loss"] for r in records if "loss" in r], proc.stdout + proc.stderr
    assert "input embedding in host memory" in logs["auto"]  # the plan line on a GPU
    assert "input embedding in host memory" not in logs["gpu"]
    assert len(losses["auto"]) == 10 and losses["auto"] == pytest.approx(losses["gpu"], rel=1e-5)


def _block_state(address: int) -> str | None:
    """The caching allocator's state of the block holding `address` ('active_allocated' while a tensor holds it,
    'inactive' once freed, merged with free neighbours or not; None: its segment went back to the driver)."""
    for segment in torch.cuda.memory_snapshot():
        at = segment["address"]
        for block in segment["blocks"]:
            if at <= address < at + block["size"]:
                return block["state"]
            at += block["size"]
    return None


@pytest.mark.parametrize("fused", [True, False])
def test_the_head_on_the_host_is_lent_to_each_forward_without_waiting_and_freed_for_backward(fused):
    """peft.offload_head on CUDA: the copy in runs on a side stream (the host is back while the GPU still sleeps);
    the loss and the gradients are those of the head on the GPU; the GPU copy's block is free once the forward has
    returned with Liger's fused loss (which reads the head in forward only), and once backward has run with a plain
    loss (whose matmul saved it). Read off the allocator's blocks, not totals: Liger keeps buffers between calls."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.models.liger import install_fused_loss, liger_loss, reference_fused_loss
    from shardtune.parallel.host_head import offload_head

    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for on_host in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False))
        model = model.to(device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
        install_fused_loss(model, liger_loss() if fused else reference_fused_loss)
        head = offload_head(model, torch.device("cuda")) if on_host else None
        lent: list[int] = []
        if head is not None:
            assert head.host.is_pinned() and model.lm_head.weight.device.type == "cpu"
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)  # GPU time queued ahead of the copy
            busy = torch.cuda.Event()
            busy.record()
            head._fetch()
            assert not busy.query(), "the copy in waited for the GPU"
            head._release()
            # after HostHead's own hook on the decoder: the copy this forward computes with
            model.model.register_forward_hook(lambda *_, seen=lent, h=head: seen.append(h.lent.data_ptr()))
        loss = model(input_ids=ids, labels=ids).loss
        if head is not None:
            assert model.lm_head.weight is head.host and len(lent) == 1
            # (a 16 MB copy has a block of the large pool to itself: no small allocation lands in it once freed)
            assert _block_state(lent[0]) == ("inactive" if fused else "active_allocated")
        loss.backward()
        if head is not None:
            assert _block_state(lent[0]) == "inactive"
        results[on_host] = (loss.item(), model.model.layers[0].mlp.up_proj.weight.grad.float().cpu())
        del model, loss, head
        gc.collect()  # the fused loss's forward is a method bound to its model: a cycle
    assert results[True][0] == results[False][0] and torch.equal(results[True][1], results[False][1])


def test_random_init_on_the_gpu_draws_in_the_parameters_dtype():
    """A preset's random init on a GPU draws each tensor in the dtype its parameter keeps: loading holds no fp32
    copy of the largest tensor beside the model (the 8B's embedding, 1.96 GiB: the peak of 8B LoRA's run in call
    125), and the values are still the fp32 draw's, cast (curand's normals are made in float for bf16 too)."""
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.models.weights import RandomInitSource, load_weights

    device = torch.device("cuda")
    model = build_on_meta(preset_config("tiny-llama")).to(torch.bfloat16)
    source = RandomInitSource(0.02, seed=0, device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    load_weights(model, source, device)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    rounding = 512 * len(sizes)  # the caching allocator's block size
    assert torch.cuda.max_memory_allocated() - before <= sum(sizes) + max(sizes) + rounding
    embedding = model.model.embed_tokens.weight
    fp32 = source.rows("model.embed_tokens.weight", embedding.shape, 0, embedding.shape[0])
    assert fp32.dtype == torch.float32 and torch.equal(embedding, fp32.to(torch.bfloat16))
