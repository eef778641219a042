"""Run under torchrun (2 gloo processes) by tests/dist/test_qlora.py: QLoRA and 8-bit AdamW under FSDP2.

    torchrun --nproc-per-node 2 tests/dist/qlora_worker.py OUT_DIR

One launch, several checks (start-up is the expensive part on CPU); rank 0 writes OUT_DIR/results.json.

QLoRA: a tiny Llama is built on the meta device, wrapped with PEFT LoRA, its LoRA base linears
replaced by NF4 skeletons (`quantize_to_nf4`), sharded with `fully_shard` per decoder block and
the root (zero3), materialised with `to_empty` and filled row-shard by row-shard, NF4 weights
through `load_nf4_rows` (the change `models/weights.py::load_weights` needs). Then 10 LoRA steps
with torch AdamW, in fp32 and under a bf16 MixedPrecisionPolicy. References run in one process
while the sharded runs wait: rank 0 the same NF4 model unsharded, rank 1 LoRA on the unquantized
fp32 base.

8-bit AdamW: full fine-tuning of a tiny Llama (hidden 128, so the shards are large enough for
quantized states), torchao AdamW8bit vs torch AdamW, both sharded; then a DCP save, 3 more steps,
and a resume from the save in a fresh model/optimizer that must repeat those 3 steps exactly.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.dist import clean_exit, init_distributed
from shardtune.models.build import restore_buffers
from shardtune.models.weights import retie, shard_rows, shared_parameters
from shardtune.peft.optim8bit import build_adamw8bit, optimizer_state_bytes
from shardtune.peft.qlora import is_nf4, load_nf4_rows, nf4_bytes, nf4_full_weight, quantize_to_nf4

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QLORA_STEPS, LORA_LR = 10, 1e-2
ADAM_STEPS, ADAM_LR = 200, 1e-3


def llama_config(hidden: int, intermediate: int):
    from transformers import LlamaConfig

    # 2 KV heads: k/v projections are a quarter of q's size, so they get smaller NF4 scaler blocks.
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                            bias="none"))


def reference_lora_model(cfg, quantize: bool):
    """The full model in one process: seeded fp32 base + PEFT's own LoRA init (same on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = lora(LlamaForCausalLM(cfg).float())
    if quantize:
        quantize_to_nf4(model, lambda n: n.endswith(".base_layer"), shard_world=2)
    return model


def batches(world: int, rank: int, n: int = 4):
    """A fixed pool of global batches of 8 sequences (learnable: arithmetic progressions mod 256);
    this rank's rows, or all of them for world 1."""
    gen = torch.Generator().manual_seed(1)
    pool = []
    for _ in range(n):
        start = torch.randint(0, 256, (8, 1), generator=gen)
        step = torch.randint(1, 7, (8, 1), generator=gen)
        rows = (start + step * torch.arange(32)) % 256
        per = 8 // world
        pool.append(rows[rank * per:(rank + 1) * per])
    return pool


def train(model, opt, steps: int, pool, world: int, check_grads=None) -> list[float]:
    losses = []
    for i in range(steps):
        ids = pool[i % len(pool)]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if check_grads is not None:
            check_grads(i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(float(value) / world)
    return losses


def shard(model, blocks, mesh, param_dtype):
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)


@torch.no_grad()
def load_rows(model, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """models/weights.py::load_weights with the one change QLoRA needs (the NF4 branch)."""
    shared = shared_parameters(model)
    model.to_empty(device=device)
    retie(model, shared)
    restore_buffers(model, device)
    for name, param in model.named_parameters():
        start, stop = shard_rows(param)
        rows = full[name][start:stop]  # stands in for source.rows(name, param.shape, start, stop)
        if is_nf4(param):
            load_nf4_rows(param, rows)  # collective: quantizes this rank's rows with the global mean
        else:
            (param.to_local() if isinstance(param, DTensor) else param).copy_(rows)


def nf4_snapshot(model) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, p in model.named_parameters():
        if is_nf4(p):
            loc = p._local_tensor if isinstance(p, DTensor) else p
            out[name] = [t.clone() for t in (loc.quantized_data, loc.quantized_scalers, loc.quantization_factor,
                                             loc.scaler_mean, loc.nf4)]
    return out


def qlora_sharded(cfg, full, mesh, ctx, param_dtype) -> dict:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = lora(LlamaForCausalLM(cfg))
    names = quantize_to_nf4(model, lambda n: n.endswith(".base_layer"), shard_world=ctx.world)
    shard(model, list(model.base_model.model.model.layers), mesh, param_dtype)
    load_rows(model, full, ctx.device)
    before = nf4_snapshot(model)

    # Memory: this rank's NF4 bytes against the bytes of the same weights quantized whole.
    local_data = sum(p._local_tensor.quantized_data.numel() for _, p in model.named_parameters() if is_nf4(p))
    full_data = sum(p.numel() // 2 for _, p in model.named_parameters() if is_nf4(p))
    local_bytes = sum(nf4_bytes(p) for _, p in model.named_parameters() if is_nf4(p))
    ref_nf4 = reference_lora_model(cfg, quantize=True)  # tiny: only to get the unsharded byte count
    full_bytes = sum(nf4_bytes(p) for _, p in ref_nf4.named_parameters() if is_nf4(p))
    n_nf4 = sum(p.numel() for _, p in model.named_parameters() if is_nf4(p))

    # Every rank rebuilds the same full weight, equal to the unsharded quantization of it.
    name0 = next(n for n, p in model.named_parameters() if is_nf4(p))
    gathered = nf4_full_weight(dict(model.named_parameters())[name0])
    unsharded = dict(ref_nf4.named_parameters())[name0].get_original_weight()
    weight_vs_unsharded = float((gathered - unsharded).abs().max())
    weight_vs_original = float((gathered - full[name0]).abs().max())

    grads = {"nf4_grad_none": True, "lora_grads_finite": True, "lora_b_grad_nonzero_at_step0": False}

    def check(step: int) -> None:
        for n, p in model.named_parameters():
            if is_nf4(p):
                grads["nf4_grad_none"] &= p.grad is None and not p.requires_grad
            elif p.requires_grad:
                grads["lora_grads_finite"] &= p.grad is not None and bool(torch.isfinite(p.grad.to_local()).all())
                if step == 0 and "lora_B" in n:  # lora_A has no signal while B is still zero
                    grads["lora_b_grad_nonzero_at_step0"] |= float(p.grad.to_local().abs().sum()) > 0

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LORA_LR, weight_decay=0.0)
    t0 = time.perf_counter()
    losses = train(model, opt, QLORA_STEPS, batches(ctx.world, ctx.rank), ctx.world, check)
    seconds = time.perf_counter() - t0
    after = nf4_snapshot(model)
    unchanged = all(all(torch.equal(a, b) for a, b in zip(before[n], after[n], strict=True)) for n in before)
    lora_b_moved = any(float(p.detach().to_local().abs().sum()) > 0
                       for n, p in model.named_parameters() if "lora_B" in n)

    # The checkpoint path the LoRA integration uses: frozen (NF4) parameters left out.
    msd, _ = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=True))
    ckpt_keys_ok = all("lora_" in k for k in msd) and len(msd) == len(trainable)
    return {"losses": losses, "seconds": seconds, "quantized_modules": len(names),
            "scaler_blocks": sorted({p._local_tensor.scaler_block_size for _, p in model.named_parameters()
                                     if is_nf4(p)}),
            "local_data_fraction": local_data / full_data, "local_bytes_fraction": local_bytes / full_bytes,
            "nf4_bytes_per_param_local": local_bytes / (n_nf4 / ctx.world),
            "weight_vs_unsharded": weight_vs_unsharded, "weight_vs_original": weight_vs_original,
            "nf4_unchanged": unchanged, "lora_b_moved": lora_b_moved, "checkpoint_keys_ok": ckpt_keys_ok,
            **grads}


def qlora_reference(cfg, quantize: bool) -> dict:
    model = reference_lora_model(cfg, quantize)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LORA_LR, weight_decay=0.0)
    t0 = time.perf_counter()
    losses = train(model, opt, QLORA_STEPS, batches(1, 0), 1)
    return {"losses": losses, "seconds": time.perf_counter() - t0}


def run_qlora(ctx, mesh) -> dict:
    cfg = llama_config(64, 128)
    full = {n: p.detach().clone() for n, p in reference_lora_model(cfg, quantize=False).named_parameters()}
    out = {"fp32": qlora_sharded(cfg, full, mesh, ctx, None),
           "bf16": qlora_sharded(cfg, full, mesh, ctx, torch.bfloat16)}
    # The one-process references, one per rank at the same time (2 cores).
    ref = qlora_reference(cfg, quantize=ctx.rank == 0)
    refs: list = [None] * ctx.world
    dist.all_gather_object(refs, ref)
    out["ref_nf4"], out["ref_fp32_base"] = refs[0], refs[1]
    return out


def adam_model(cfg, mesh):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    shard(model, list(model.model.layers), mesh, None)
    return model


def timed_steps(model, opt, steps, pool, world, sched=None):
    losses, times = [], []
    for i in range(steps):
        ids = pool[i % len(pool)]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world)
    return losses, times


def run_adamw8bit(ctx, mesh, out: Path) -> dict:
    cfg = llama_config(128, 256)
    pool = batches(ctx.world, ctx.rank, n=8)

    def schedule(opt):  # the project's scheduler type (LambdaLR): torchao keeps lr as a tensor
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * ADAM_STEPS))

    model = adam_model(cfg, mesh)
    opt = build_adamw8bit(model.parameters(), lr=ADAM_LR, weight_decay=0.01)
    sched = schedule(opt)
    losses8, times8 = timed_steps(model, opt, ADAM_STEPS, pool, ctx.world, sched)
    bytes8 = optimizer_state_bytes(opt)
    quantized = sum(type(s["exp_avg"]._local_tensor).__name__ == "OptimState8bit" for s in opt.state.values())

    ref = adam_model(cfg, mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ADAM_LR, weight_decay=0.01, fused=True)  # 4x foreach on CPU
    losses32, times32 = timed_steps(ref, ref_opt, ADAM_STEPS, pool, ctx.world, schedule(ref_opt))
    bytes32 = optimizer_state_bytes(ref_opt)

    # Checkpoint round trip through DCP: save, go on 3 steps, resume from the save elsewhere.
    ckpt = out / "adamw8bit-ckpt"
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    sched_state = sched.state_dict()
    cont, _ = timed_steps(model, opt, 3, pool[ADAM_STEPS % len(pool):] + pool, ctx.world, sched)

    model2 = adam_model(cfg, mesh)
    opt2 = build_adamw8bit(model2.parameters(), lr=ADAM_LR, weight_decay=0.01)
    sched2 = schedule(opt2)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(ckpt))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched2.load_state_dict(sched_state)
    resumed, _ = timed_steps(model2, opt2, 3, pool[ADAM_STEPS % len(pool):] + pool, ctx.world, sched2)
    state_types = sorted({type(s["exp_avg"]._local_tensor).__name__ for s in opt2.state.values()})
    return {"losses_8bit": losses8, "losses_fp32": losses32, "state_bytes_per_param_8bit": bytes8,
            "state_bytes_per_param_fp32": bytes32, "quantized_states": quantized, "states": len(opt.state),
            "step_s_8bit": sorted(times8)[len(times8) // 2], "first_step_s_8bit": times8[0],
            "step_s_fp32": sorted(times32)[len(times32) // 2], "continued": cont, "resumed": resumed,
            "resumed_state_types": state_types, "lr_after": float(opt.param_groups[0]["lr"])}


def main() -> None:
    out = Path(sys.argv[1])
    ctx = init_distributed()
    torch.set_num_threads(1)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("fsdp",))
    results = {"world": ctx.world, "qlora": run_qlora(ctx, mesh), "adamw8bit": run_adamw8bit(ctx, mesh, out)}
    for part in results["qlora"].values():
        assert all(math.isfinite(x) for x in part["losses"]), part
    if ctx.is_main:
        (out / "results.json").write_text(json.dumps(results, indent=2))
    clean_exit(0)


if __name__ == "__main__":
    main()
