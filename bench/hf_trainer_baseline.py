"""Reference points users know: Hugging Face Trainer (+ PEFT, + bitsandbytes, + a DeepSpeed config).

    torchrun --nproc_per_node=N bench/hf_trainer_baseline.py --mode lora|qlora --size 8b [--steps 20]
    torchrun --nproc_per_node=N bench/hf_trainer_baseline.py --mode full --size 1b --mbs 4 --no-ac \
        --deepspeed ds.json      # e.g. written by `shardtune plan CONFIG --emit deepspeed`

Random-init Llama shape, random token ids, seq 2048, bf16. lora / qlora: LoRA r=16 on every linear layer
of the blocks, micro-batch 2, gradient checkpointing: the recipe most users start from (HF + PEFT docs).
full: every weight trains (fp32 weights, as HF Trainer + DeepSpeed holds them), through the DeepSpeed
config given (TrainingArguments is built before the model, so ZeRO-3 initialises partitioned).
HF_LIGER=1 in the environment adds `use_liger_kernel=True` (Liger-Kernel through the Trainer; mode gets `_liger`).
Prints one line `RESULT {json}` on rank 0 (tokens/s per GPU: median step; peak memory: max over ranks).
QLoRA needs bitsandbytes and a GPU; with several GPUs it runs data-parallel (each GPU holds the
whole 4-bit model: bitsandbytes' 4-bit weights cannot be sharded by FSDP2).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _init_device() -> torch.device:
    """Where random init runs (the Trainer moves the model to this GPU anyway)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def build(args: argparse.Namespace):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    cfg = LlamaConfig(**SIZES[args.size], max_position_embeddings=max(4096, args.seq))
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    if args.mode == "qlora":
        # bitsandbytes quantizes at load time; a random-init model is saved once and loaded quantized.
        path = f"/tmp/hf_peft_{args.size}"
        if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not os.path.exists(path):
            with _init_device():  # random init on the GPU: minutes faster than on the host for 8B
                AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(path)
            torch.cuda.empty_cache()
            # The bf16 model made to be saved (15.0 GiB on the 8B shape) is not the run's: its peak was the
            # baseline's "peak memory" in every call that made the folder (2026-12-02 to 12-04; 11.2 otherwise).
            torch.cuda.reset_peak_memory_stats()
        if dist.is_initialized():
            dist.barrier()
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=dtype,
                                                     device_map={"": int(os.environ.get("LOCAL_RANK", 0))})
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        with _init_device():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    if args.mode == "full":
        return cfg, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return cfg, get_peft_model(model, lora)


def _flops_per_token(cfg, model, seq: int) -> float:
    """6·N + 12·L·h·s, N without an untied input embedding (bench/README.md's MFU, the same for every row)."""
    n = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


def main() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["lora", "qlora", "full"], default="lora")
    ap.add_argument("--size", choices=list(SIZES), default="8b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-ac", action="store_true", help="no gradient checkpointing")
    ap.add_argument("--deepspeed", default=None, help="a DeepSpeed config file for TrainingArguments")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    gpu = torch.cuda.is_available()
    liger = os.environ.get("HF_LIGER") == "1"
    # Before the model: with a ZeRO-3 config, from_config then builds it partitioned (deepspeed.zero.Init).
    targs = TrainingArguments(output_dir=f"/tmp/hf_trainer_out_{args.mode}", per_device_train_batch_size=args.mbs,
                              max_steps=args.steps, learning_rate=1e-4 if args.mode != "full" else 1e-5,
                              bf16=gpu, logging_steps=10**6, save_strategy="no", report_to=[],
                              dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=not args.no_ac,
                              use_cpu=not gpu, gradient_checkpointing_kwargs={"use_reentrant": False},
                              deepspeed=args.deepspeed,
                              # Liger's kernels through the Trainer, as axolotl and LLaMA-Factory users turn them on
                              # (the same switch as ../shared/device/hf_baseline.py); needs liger-kernel and a GPU.
                              use_liger_kernel=liger)
    cfg, model = build(args)
    times: list[float] = []
    steps: list[dict] = []  # each timed step's time and, where NVML answers, the GPU's power, SM clock, heat
    sampler = _sampler() if gpu and int(os.environ.get("RANK", 0)) == 0 else None
    steady_peak: list[tuple[float, float]] = []  # the warm-up steps' peaks, read before the counters start again

    class Timer(TrainerCallback):
        def on_step_begin(self, a, s, c, **kw):
            if gpu:
                torch.cuda.synchronize()
                if s.global_step == args.warmup:  # the timed steps' own peak from here (shardtune's records too)
                    steady_peak.append((torch.cuda.max_memory_allocated() / 2**30,
                                        torch.cuda.max_memory_reserved() / 2**30))
                    torch.cuda.reset_peak_memory_stats()
            if sampler:
                sampler.take()  # the samples between steps are not this step's
            self.t0 = time.perf_counter()

        def on_step_end(self, a, s, c, **kw):
            if gpu:
                torch.cuda.synchronize()
            if s.global_step > args.warmup:
                times.append(time.perf_counter() - self.t0)
                steps.append({"step": s.global_step, "step_time_s": round(times[-1], 4),
                              **(sampler.take() if sampler else {})})

    world = targs.world_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.mbs * world * (args.steps + 1), args.seq), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timer()]).train()
    if sampler:
        sampler.close()
    timed = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if gpu else (0, 0)
    warm = steady_peak[0] if steady_peak else (0.0, 0.0)
    # [the run's allocated peak, the timed steps' own, the run's reserved peak]
    peak = torch.tensor([max(timed[0], warm[0]), timed[0], max(timed[1], warm[1])], device="cuda" if gpu else "cpu")
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    med = sorted(times)[len(times) // 2] if times else float("nan")
    fpt = _flops_per_token(cfg, model, args.seq)
    if int(os.environ.get("RANK", 0)) == 0:
        mode = f"hf_peft_{args.mode}" if args.mode != "full" else "hf_trainer" + ("_ds" if args.deepspeed else "")
        mode += "_liger" if liger else ""
        print("RESULT " + json.dumps({"mode": mode, "size": args.size, "world": world,
                                      "seq": args.seq, "mbs": args.mbs, "step_s_median": round(med, 4),
                                      "precision": "bf16" if gpu else "fp32",  # TrainingArguments(bf16=gpu)
                                      "liger": liger,
                                      "tokens_per_s_per_gpu": round(args.mbs * args.seq / med),
                                      "mfu_989": round(args.mbs * args.seq / med * fpt / 989e12, 4),
                                      # the spread, for bench/summarize.py's min-max column
                                      "steps_timed": len(times),
                                      "tokens_per_s_per_gpu_min": round(args.mbs * args.seq / max(times))
                                      if times else None,
                                      "tokens_per_s_per_gpu_max": round(args.mbs * args.seq / min(times))
                                      if times else None,
                                      "peak_alloc_gib": round(float(peak[0]), 2),
                                      "peak_alloc_steady_gib": round(float(peak[1]), 2),
                                      "peak_reserved_gib": round(float(peak[2]), 2),
                                      "steps": steps}), flush=True)


def _sampler():
    """shardtune's NVML sampler (its src on PYTHONPATH, nvidia-ml-py installed), started, or None: each timed step's
    GPU power, SM clock and temperature beside shardtune's own rows. HF + PEFT + Liger's median moved 7,991 ->
    7,104 tokens/s between calls on one warm H100 while shardtune's stayed within 0.2% (bench/RESULTS.md,
    forty-fourth session); its min-max spread was 2x. Sampled every second, as shardtune's runs are (its thread takes
    the GIL that HF's host-paced loop needs as often as theirs does; a step without a sample of its own gets one)."""
    try:
        from shardtune.metrics.system import SystemSampler
    except ImportError:
        return None
    sampler = SystemSampler()
    return sampler.start() if sampler.handles else None


if __name__ == "__main__":
    main()
