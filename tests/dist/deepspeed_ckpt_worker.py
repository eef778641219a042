"""Run under torchrun (1 or 2 gloo processes) by tests/dist/test_deepspeed_checkpoints.py: real DeepSpeed
checkpoints of a small Llama (micro-llama), laid out as shardtune step directories.

    torchrun --nproc-per-node 2 tests/dist/deepspeed_ckpt_worker.py OUT_DIR VARIANT [VARIANT ...]

A variant is STRATEGY-PRECISION-KIND[-OFFLOAD], e.g. zero3-fp32-full, zero2-bf16-lora, ddp-fp32-full
(ddp = ZeRO stage 0), zero3-fp32-full-params (parallel.offload=params), zero3-fp32-full-odd (a
micro-llama with odd tensor sizes and an untied LM head; full fine-tuning only: the trainer state
still names the preset). The DeepSpeed config is the one
shardtune generates (parallel/ds_config.py). Each trains 2 optimizer steps through shardtune's DeepSpeedBackend and then
writes OUT_DIR/VARIANT/checkpoints/step-00000002/ as the training loop does: trainer_state.json,
hf/ (config + tokenizer, + adapter_config.json for LoRA), deepspeed/ (engine.save_checkpoint
through backend.save_native), and manifest.json last ("format": "deepspeed"). Next to the
checkpoints rank 0 writes OUT_DIR/VARIANT/reference.safetensors: the logits of a fixed batch
through the backend at save time ("logits"), every trainable parameter as the backend holds it
(gathered under ZeRO-3; in the compute dtype, e.g. bf16 module copies for bf16 runs), and the logits
after one more step ("logits_moved") and again after DeepSpeed re-read the checkpoint through
DeepSpeedFormat.read (pickles checked, backend.load_native inside weights_only_loads)
("logits_reloaded"; every torch.load it made had weights_only=True).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.checkpoint.deepspeed_files import NATIVE_DIR, TAG, DeepSpeedFormat
from shardtune.checkpoint.hf_export import SAVE_DTYPES
from shardtune.checkpoint.layout import TRAINER_STATE, finalize
from shardtune.config import ModelConfig, OptimConfig, ParallelConfig, PeftConfig, TrainConfig
from shardtune.data import Batch
from shardtune.dist import clean_exit, init_distributed
from shardtune.models.build import build_on_meta, write_config
from shardtune.models.facts import decoder_blocks
from shardtune.models.presets import preset_config
from shardtune.models.tokenizer import load_tokenizer
from shardtune.models.weights import make_source
from shardtune.parallel.deepspeed_engine import DeepSpeedBackend
from shardtune.parallel.ds_config import deepspeed_config
from shardtune.peft.lora import LoraSource, apply_lora
from shardtune.train.loss import token_loss_sum
from shardtune.train.optim import OptimizerFactory, build_scheduler

STEPS, MICRO, SEQ = 2, 2, 16
PEFT = PeftConfig(method="lora", r=4, alpha=8.0)
ODD = {"hidden_size": 65, "head_dim": 16, "intermediate_size": 171, "num_attention_heads": 5,
       "num_key_value_heads": 1, "tie_word_embeddings": False}


def fixed_batch() -> torch.Tensor:
    return torch.randint(4, 500, (2, SEQ), generator=torch.Generator().manual_seed(1234))


def make_variant(out: Path, variant: str, ctx) -> None:
    strategy, precision, kind, *rest = variant.split("-")
    offload = next((x for x in rest if x != "odd"), "none")
    hf = preset_config("micro-llama")
    if "odd" in rest:  # odd-sized tensors: ZeRO pads partitions; an untied LM head
        hf.update(ODD)
    mcfg = ModelConfig(preset="micro-llama", seed=0)
    model = build_on_meta(hf)
    base = model
    source = make_source(mcfg, hf, ctx.device)
    if kind == "lora":
        shapes = {name: p.shape for name, p in model.named_parameters()}
        model = apply_lora(model, PEFT, hf.model_type)
        source = LoraSource(source, mcfg.seed, shapes)
    parallel = ParallelConfig(backend="deepspeed", strategy=strategy, offload=offload)
    train = TrainConfig(precision=precision, micro_batch_size=MICRO, grad_accum=1)
    ds = deepspeed_config(parallel, train, OptimConfig(), {}, ctx.world)
    backend = DeepSpeedBackend(parallel, precision, ctx, ds, token_loss_sum)
    lr = 1e-2 if kind == "lora" else 1e-3
    optim = OptimConfig(warmup_steps=1)
    backend.setup(model, decoder_blocks(model, hf.model_type), source, OptimizerFactory(optim, lr))
    schedule = build_scheduler(backend.optimizer, optim, 10)

    def step() -> None:  # what the training loop does after its micro-batches
        backend.step()
        if backend.step_applied:
            schedule.step()
    g = torch.Generator().manual_seed(ctx.rank)
    norm = torch.tensor(float(MICRO * ctx.world * (SEQ - 1)))
    for _ in range(STEPS):
        x = torch.randint(4, 500, (MICRO, SEQ), generator=g)
        backend.forward_backward(Batch(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone()), norm)
        step()

    root = out / variant / "checkpoints"
    tmp = root / f".step-{STEPS:08d}.tmp"
    if ctx.is_main:
        (tmp / "rng").mkdir(parents=True)
        config = {"model": mcfg.model_dump(mode="json"), "train": {"precision": precision},
                  "parallel": {"backend": "deepspeed", "strategy": strategy},
                  "peft": PEFT.model_dump(mode="json") if kind == "lora" else {"method": "none"}}
        (tmp / TRAINER_STATE).write_text(json.dumps({"step": STEPS, "world_size": ctx.world, "config": config,
                                                      "strategy": strategy}))
        dtype = SAVE_DTYPES["fp32" if precision == "fp32" else "bf16"]
        write_config(base, hf, load_tokenizer(None), tmp / "hf", dtype)
        if model is not base:
            model.peft_config["default"].save_pretrained(str(tmp / "hf"))
    dist.barrier()
    backend.save_native(tmp / NATIVE_DIR, TAG)

    # The reference: what the backend holds at save time.
    backend.train(False)
    x = fixed_batch()
    with torch.no_grad():
        logits = backend.forward(Batch(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone()))
    reference = {"logits": logits.float().contiguous()}
    for name, param in backend.module.named_parameters():
        if param.requires_grad:
            reference[name] = backend.full_tensor(param).contiguous()  # collective under ZeRO-3
    # One more step moves the weights; DeepSpeed's own resume from the files just written (its reads
    # forced to weights_only) must bring back the saved model.
    backend.train(True)
    x1 = torch.randint(4, 500, (MICRO, SEQ), generator=g)
    backend.forward_backward(Batch(input_ids=x1, attention_mask=torch.ones_like(x1), labels=x1.clone()), norm)
    step()
    backend.train(False)
    with torch.no_grad():
        moved = backend.forward(Batch(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone()))
    reference["logits_moved"] = moved.float().contiguous()
    seen: list[bool] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only") is True)
        return real_load(*args, **kwargs)

    torch.load = spy
    try:
        DeepSpeedFormat().read(backend, tmp)  # what a resume runs: pickles checked, reads weights_only
    finally:
        torch.load = real_load
    assert seen and all(seen), seen
    with torch.no_grad():
        again = backend.forward(Batch(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone()))
    reference["logits_reloaded"] = again.float().contiguous()
    dist.barrier()
    if ctx.is_main:
        from safetensors.torch import save_file

        save_file(reference, str(out / variant / "reference.safetensors"))
        finalize(tmp, root / f"step-{STEPS:08d}", {"step": STEPS, "world_size": ctx.world, "format": "deepspeed"})
    dist.barrier()


def main() -> None:
    ctx = init_distributed()
    out = Path(sys.argv[1])
    for variant in sys.argv[2:]:
        make_variant(out, variant, ctx)
        if ctx.is_main:
            print("done", variant, flush=True)
    clean_exit(0)


if __name__ == "__main__":
    main()
