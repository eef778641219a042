"""Typed run config: one YAML file with sections, dotted command-line overrides, one-line errors.

Each component gets its own section model (ModelConfig, DataConfig, ...) and receives only that
section. Anything a user can get wrong raises ConfigError with a single line naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardtune.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str | None = Field(None, description="Local Hugging Face model directory (config.json + safetensors).")
    preset: str | None = Field(None, description="Built-in shape with random init, e.g. tiny-llama (no files).")
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = "sdpa"
    seed: int = Field(0, description="Seed of a preset's random init (same weights as `init-model --seed`).")
    liger: bool | Literal["auto", "loss"] = Field(
        "auto", description="Liger-Kernel (CUDA, liger-kernel installed): true = its RMSNorm, RoPE and SwiGLU kernels "
                            "and fused linear + cross-entropy; loss = the fused loss only; auto = where it can run, "
                            "the fused loss only under parallel.compile (Inductor fuses the rest), else all; "
                            "false = never.")
    liger_chunk: int | Literal["auto"] = Field(
        "auto", description="Tokens whose logits Liger's fused loss makes at once (a power of two near it; never "
                            "fewer than Liger's own choice, about tokens x hidden / vocab: 256 at 1B, micro-batch "
                            "4). Larger chunks mean fewer, larger matmuls and, when the LM head trains, its fp32 "
                            "gradient read and written fewer times; each holds tokens x vocab x 2 bytes (263 MB at "
                            "1024 and a 128k vocabulary). 0 = Liger's own. auto: 1024 (one H200: full fine-tuning "
                            "at 1B 14% faster, 8B LoRA 2% faster, at the same peak).")
    liger_accum: Literal["fp32", "weight"] = Field(
        "weight", description="What Liger's fused loss sums the LM head's gradient in over its chunks, when the "
                              "head trains: weight (the head weight's dtype: Liger's own default and what Hugging "
                              "Face Trainer's use_liger_kernel runs; one bf16 rounding per chunk), or fp32 (an fp32 "
                              "accumulator, vocab x hidden x 4 bytes, cast to the weight's dtype after the last "
                              "chunk). One H100, 1B full fine-tuning at micro-batch 4: weight 1.6-2.2% faster and "
                              "0.73 GiB less peak, the same losses to 3e-5.")
    trust_remote_code: bool = Field(False, description="Run the Python code a model folder ships (config.json "
                                                       "auto_map) with your permissions; only for code you have read.")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="The model's positions for this run (e.g. 131072 to train long sequences); pair a "
                                "raise with model.rope_scaling. An exported full model's config.json carries both; "
                                "an adapter's base model needs them set where it is loaded.")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="RoPE scaling for this run, as transformers' rope_scaling: {rope_type: llama3 | linear | "
                          "dynamic | yarn, factor: 8.0, ...}; replaces the model's scaling, keeps its rope_theta.")

    @field_validator("liger_chunk")
    @classmethod
    def _chunk(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be >= 0 (0 = Liger's own chunk) or 'auto'")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.preset is None):
            raise ValueError("set exactly one of model.path (a local HF directory) or model.preset (e.g. tiny-llama)")
        if self.preset is not None:
            from shardtune.models.presets import PRESETS

            if self.preset not in PRESETS:
                raise ValueError(f"model.preset: {self.preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
        return self


FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca")
# Logical fields a row format reads, and the column names they have unless `fields` maps them.
DEFAULT_FIELDS = {"text": "text", "prompt": "prompt", "completion": "completion", "messages": "messages",
                  "instruction": "instruction", "input": "input", "output": "output"}


def _check_fields(v: dict[str, str]) -> dict[str, str]:
    for key in v:
        if key not in DEFAULT_FIELDS:
            raise ValueError(f"unknown field {key!r}{_suggest(key, DEFAULT_FIELDS)}; "
                             f"fields are {', '.join(DEFAULT_FIELDS)}")
    return v


class SourceConfig(_Section):
    path: str = Field(..., description="File (.jsonl .json .parquet .csv), folder of them, or a `datasets` "
                                       "save_to_disk folder.")
    format: Literal["auto", "text", "prompt_completion", "messages", "alpaca"] = "auto"
    fields: dict[str, str] = Field(default_factory=dict, description="Logical field -> column, e.g. "
                                                                     "{prompt: question, completion: answer}.")
    weight: float = Field(1.0, gt=0.0, description="Examples per epoch as a multiple of the source's size.")
    split: str | None = Field(None, description="Split of a saved DatasetDict (default: train).")

    @field_validator("fields")
    @classmethod
    def _known_fields(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_fields(v)

    def column(self, name: str) -> str:
        """The column that holds logical field `name` in this source's rows."""
        return self.fields.get(name, DEFAULT_FIELDS[name])


class DataConfig(_Section):
    train_file: str | None = Field(None, description="Shorthand for one source: sources: [{path: ...}].")
    format: Literal["auto", "text", "prompt_completion", "messages", "alpaca"] = Field(
        "auto", description="Format of train_file (auto: detected from the first row).")
    fields: dict[str, str] = Field(default_factory=dict, description="Column mapping of train_file.")
    sources: list[SourceConfig] = Field(default_factory=list, description="Several sources, mixed by weight.")
    eval_file: str | None = Field(None, description="Separate held-out data; if unset, eval_fraction of each source.")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of each source held out for eval.")
    chat_template: str = Field("auto", description="auto (the tokenizer's, else chatml), tokenizer, a built-in "
                                                   "name (chatml, llama3, zephyr) or a .jinja file.")
    train_on: Literal["assistant", "completion", "all"] = Field(
        "assistant", description="Loss on every assistant turn, only the last one, or every token.")
    add_eos: bool = Field(True, description="End each example with the tokenizer's EOS (it carries loss).")
    truncation: Literal["truncate", "drop"] = Field("truncate", description="Examples longer than train.seq_len.")
    packing: bool = Field(False, description="Pack examples into full rows; attention stays within each example.")
    max_examples: int | None = Field(None, ge=1, description="Train on a deterministic subset of at most N.")
    fraction: float = Field(1.0, gt=0.0, le=1.0, description="Train on a deterministic share of the examples.")
    strict: bool = Field(False, description="Stop at the first bad row instead of skipping and counting it.")
    cache_dir: str | None = Field(None, description="Tokenization cache (default ~/.cache/shardtune/data).")
    num_proc: int | Literal["auto"] = Field("auto", description="Tokenizer worker processes.")

    @model_validator(mode="after")
    def _one_way(self) -> DataConfig:
        if (self.train_file is None) == (not self.sources):
            raise ValueError("data: set exactly one of data.train_file (one file) or data.sources (a list)")
        try:
            _check_fields(self.fields)
        except ValueError as err:
            raise ValueError(f"data.fields: {err}") from None
        return self

    def all_sources(self) -> list[SourceConfig]:
        """The training sources, with the train_file shorthand expanded."""
        if self.train_file is not None:
            return [SourceConfig(path=self.train_file, format=self.format, fields=self.fields)]
        return list(self.sources)


class ParallelConfig(_Section):
    strategy: Literal["ddp", "zero1", "zero2", "zero3", "hsdp", "auto"] = Field(
        "zero3", description="ddp (replicas), zero1/zero2/zero3 (ZeRO stages), hsdp (zero3 inside groups of "
                             "shard_size processes, replicated across groups), auto (the planner's pick).")
    shard_size: int | Literal["auto"] = Field("auto", description="hsdp: processes that share one copy of the "
                                                                  "sharded model; auto = processes per node.")
    backend: Literal["fsdp2", "deepspeed"] = Field("fsdp2", description="The engine behind the strategy: PyTorch "
                                                                        "FSDP2 / DDP, or DeepSpeed ZeRO.")
    nproc: int | Literal["auto"] = Field("auto", description="Processes on this node; auto = all GPUs, or 1 on CPU.")
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none", description="full: each decoder block keeps its input and runs again in backward; selective: it keeps "
                            "its attention output and every other matmul output and recomputes the rest (torchtitan's "
                            "per-op selective checkpointing).")
    checkpoint_blocks: int | None = Field(
        None, ge=0, description="With activation_checkpointing full: checkpoint only the first N decoder blocks; the "
                                "others keep their activations for backward and are not run again (Megatron's "
                                "recompute_method block with recompute_num_layers N): each block left out saves "
                                "its recompute, for its activations' memory (the planner prices both). Unset: "
                                "every block. With activation_offload the first N blocks' inputs go to the host; the "
                                "others keep their activations on the GPU.")
    tiled_mlp: int | None = Field(
        None, ge=1, description="Run each decoder block's MLP over tiles of this many tokens (the micro-batch's "
                                "tokens flattened), each tile under its own checkpoint (Arctic Long Sequence "
                                "Training's TiledMLP, Unsloth's tiled MLP): the block keeps only the MLP's input, "
                                "and a tile's intermediates live only while its backward runs, for one more MLP "
                                "forward per step. For sequences too long for the GPU (with activation_checkpointing "
                                "full, the recompute's working set). Under compile the tiles run eagerly and the "
                                "checkpoint goes around the compiled blocks. Not with selective checkpointing or "
                                "an activation_memory_budget. Unset: off.")
    compile: bool = Field(False, description="torch.compile each decoder block before sharding.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode for each block (with parallel.compile): reduce-overhead adds "
                               "CUDA graphs (fewer kernel launches from the host, more memory), max-autotune "
                               "benchmarks Triton / cuBLAS choices while compiling (minutes) and adds CUDA graphs, "
                               "max-autotune-no-cudagraphs without them. CUDA graphs not with the checkpoint "
                               "around the compiled blocks (checkpoint_in_compile false, or auto with "
                               "activation_offload: pytorch/pytorch#154306).")
    compile_options: dict[str, Any] | None = Field(
        None, description="Inductor options for each block's torch.compile (its options=; the names "
                          "torch._inductor.config has), e.g. {cpp_wrapper: true}: a C++ wrapper that "
                          "launches the block's kernels with less host time per kernel, compiled once. Not with a "
                          "compile_mode other than default (torch takes one or the other).")
    checkpoint_in_compile: bool | Literal["auto"] = Field(
        "auto", description="With parallel.compile and activation_checkpointing: checkpoint inside each block's "
                            "compiled code (torchtitan's order: checkpoint, then compile), so the recompute runs "
                            "inside the compiled backward and leaves out what no gradient reads; false: around it "
                            "(a recompute from Python, which CUDA graphs cannot run). auto: inside, except with "
                            "activation_offload (long sequences, where inside's backward holds ~3.5 x p x f bytes per "
                            "token more; true runs the two together). On one H100, inside against around: 8B "
                            "LoRA bf16 +8.6%, QLoRA +8.5%, float8 micro-batch 4 +6% (2.01x HF + PEFT + Liger), at "
                            "0.4-0.6 GiB more at 4,096 tokens. The planner prices around beside auto's inside: "
                            "parallel.strategy: auto writes false where only around fits or it is faster (long "
                            "sequences). Selective checkpointing under compile is always inside (its per-op "
                            "policy sees the ops only there).")
    activation_memory_budget: float | None = Field(
        None, ge=0.0, le=1.0,
        description="With parallel.compile and activation_checkpointing none: the share of each compiled block's "
                    "activations that compile's partitioner may keep for backward, from what full checkpointing "
                    "keeps (0: the block's inputs) to what it keeps by default (1); the rest is recomputed in the "
                    "compiled backward, the cheapest bytes first (torch._functorch.config.activation_memory_budget, "
                    "torchtitan's activation_checkpoint.mode memory_budget). Unset: the default partitioner. The "
                    "planner prices it between none and full from GPU measurements (8B LoRA float8 on one H100: "
                    "0.3 / 0.5 kept 0.37 / 0.52 of the way, +10% / +14% over full checkpointing) and, under "
                    "parallel.strategy auto with compiled blocks, tries 0.3 and 0.5.")
    activation_offload: bool = Field(
        False, description="Keep what autograd saves in the decoder in host memory (pinned on GPUs), copied out in "
                           "forward and back in backward (as torch.autograd.graph.save_on_cpu, in power-of-two "
                           "pieces; on GPUs both copies run on a side stream, overlapped with compute). With "
                           "activation_checkpointing: full that is each block's input, which bounds the longest "
                           "trainable sequence; without checkpointing, everything the blocks save (compiled under "
                           "parallel.activation_memory_budget: the share it keeps). Not with selective "
                           "checkpointing under compile, nor with fsdp2's ddp (autocast). Under "
                           "parallel.strategy: auto the planner turns it on where nothing fits without it.")
    one_gpu: Literal["auto", "fsdp2", "direct"] = Field(
        "auto", description="How zero2 / zero3 run on a single process. fsdp2: FSDP2 on a mesh of one (it still "
                            "casts each weight into its all-gather buffer and out, and copies the gradients "
                            "through a one-rank reduce-scatter). direct: no FSDP2; the model holds compute-dtype "
                            "copies of the trainable weights and the optimizer their fp32 masters, one cast each "
                            "way per step (as DeepSpeed's bf16 optimizer): the same arithmetic, fewer bytes moved "
                            "(1B full fine-tuning on one H200: 7% faster, 5.5 GiB less reserved). Checkpoints are "
                            "the same DCP files (resume on any GPU count). Not with fp16. LoRA's A and B matrices cast "
                            "in their forward instead (no copy kept: 8B LoRA / QLoRA on one H200 4% / 7% faster "
                            "at the same peak). auto: direct where that was measured (bf16 with AdamW on one "
                            "process: full fine-tuning, LoRA and QLoRA; with parallel.activation_offload LoRA and "
                            "QLoRA only), else fsdp2.")
    shard_frozen: bool | Literal["auto"] = Field(
        "auto", description="Whether FSDP2 manages the frozen base weights stored in the compute dtype (LoRA's base, "
                            "QLoRA's embeddings and norms) like the others: sharded over the processes and gathered "
                            "for each block. false keeps them whole on every GPU, outside FSDP2: no all-gather of "
                            "them (nor its copy on one GPU) and no gathered root while a fused loss runs, for their "
                            "whole size on every GPU. auto: false on one process (nothing to shard there; measured "
                            "faster and smaller), true on several (the trade is not measured yet). Frozen weights in "
                            "another dtype (peft.base_dtype: fp32 under bf16) stay with FSDP2, which casts them. "
                            "zero2 / zero3 / hsdp.")
    offload: Literal["none", "optimizer", "params"] = Field(
        "none", description="DeepSpeed ZeRO-Offload: optimizer states (optimizer), or parameters and optimizer "
                            "states (params, zero3 only), kept in CPU memory (or on NVMe, see offload_nvme_path).")
    offload_nvme_path: str | None = Field(None, description="Offload to NVMe files in this folder instead of CPU "
                                                            "memory (ZeRO-Infinity; zero3 only).")

    @field_validator("nproc", "shard_size")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @model_validator(mode="after")
    def _compile_settings(self) -> ParallelConfig:
        if (self.compile_mode != "default" or self.compile_options) and not self.compile:
            raise ValueError("parallel.compile_mode / parallel.compile_options need parallel.compile=true")
        if self.compile_options and self.compile_mode != "default":
            raise ValueError("set parallel.compile_mode or parallel.compile_options, not both (torch.compile takes "
                             "one or the other)")
        if self.compile_options:
            _check_inductor_options(self.compile_options)
        if self.activation_memory_budget is not None:
            if not self.compile:
                raise ValueError("parallel.activation_memory_budget needs parallel.compile=true (compile's "
                                 "partitioner decides what to recompute)")
            if self.activation_checkpointing != "none":
                raise ValueError("set parallel.activation_memory_budget or parallel.activation_checkpointing, not "
                                 "both (the budget decides what each block recomputes; checkpointing decides it "
                                 "by itself)")
        if self.checkpoint_blocks is not None and self.activation_checkpointing != "full":
            raise ValueError("parallel.checkpoint_blocks needs parallel.activation_checkpointing=full (it says how "
                             "many blocks full checkpointing takes)")
        if self.tiled_mlp is not None:
            if self.activation_checkpointing == "selective":
                raise ValueError("parallel.tiled_mlp is not built for selective checkpointing (its policy would keep "
                                 "what the tiles recompute); use activation_checkpointing=full or none")
            if self.activation_memory_budget is not None:
                raise ValueError("set parallel.tiled_mlp or parallel.activation_memory_budget, not both (the tiles "
                                 "run outside the compiled graph the budget partitions)")
            if self.checkpoint_in_compile is True and self.activation_checkpointing == "full":
                raise ValueError("parallel.tiled_mlp runs its tiles outside the compiled blocks, so the checkpoint "
                                 "goes around them: set parallel.checkpoint_in_compile=auto (or false)")
        if self.checkpoint_in_compile is True and not self.compile:
            raise ValueError("parallel.checkpoint_in_compile needs parallel.compile=true (it checkpoints inside "
                             "the compiled blocks)")
        return self


def _check_inductor_options(options: dict[str, Any]) -> None:
    """The names and value types torch.compile(options=...) accepts (its own check, made at config load instead
    of at the first forward)."""
    from torch._inductor import config as inductor

    known = inductor.get_config_copy()
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"parallel.compile_options: {key!r} is not an Inductor option{_suggest(name, known)} "
                             "(the names are torch._inductor.config's)")
        current = known[name]
        if isinstance(current, bool | int | float | str) and not isinstance(value, type(current)):
            raise ValueError(f"parallel.compile_options: {key} takes a {type(current).__name__} (default "
                             f"{current!r}), got {value!r}")


class OptimConfig(_Section):
    name: Literal["adamw", "adamw8bit"] = Field("adamw", description="adamw, or adamw8bit (torchao: 8-bit "
                                                                     "states, ~2 instead of 8 bytes per parameter).")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps (takes precedence over warmup_ratio).")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final LR as a fraction of train.lr.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Clip the global grad norm; 0 disables clipping.")
    fused: bool | Literal["auto", "compiled"] = Field(
        "auto", description="Fused AdamW kernel; auto = on GPU and CPU, except fp16 under FSDP2 sharding (foreach), "
                            "and compiled on a GPU where it was measured faster (the one-GPU direct path, AdamW, bf16 "
                            "full fine-tuning with parallel.compile, one micro-batch a step, no float8). "
                            "compiled: on the one-GPU direct path (parallel.one_gpu), the gradient norm, clipping, "
                            "AdamW and the cast to the compute-dtype weights as torch.compile'd code, reading "
                            "a step's only micro-batch's gradients in the compute dtype (no fp32 gradients).")


class TrainConfig(_Section):
    lr: float = Field(2e-5, gt=0.0)
    precision: Literal["bf16", "fp16", "fp32"] = Field(  # fp8 is read as bf16 + float8 (_fp8)
        "bf16", description="Compute precision; fp8 = bf16 with train.float8=tensorwise (what the saved config says).")
    float8: Literal[False, "tensorwise", "rowwise"] = Field(
        False, description="torchao float8 training of the transformer blocks' Linear layers (tensorwise or rowwise "
                           "dynamic scales; the LM head and embeddings stay bf16; with LoRA the frozen base layers): "
                           "bf16, fsdp2, GPUs of compute capability 8.9+.")

    @model_validator(mode="before")
    @classmethod
    def _fp8(cls, data: Any) -> Any:
        """precision: fp8 (the name DeepSpeed / accelerate users know) is bf16 with float8 matmuls."""
        if not isinstance(data, dict) or str(data.get("precision")).lower() != "fp8":
            return data
        if data.get("float8", "tensorwise") in (False, "false", "False", None):
            raise ValueError("train.precision: fp8 means bf16 with train.float8=tensorwise; drop train.float8=false, "
                             "or set train.precision=bf16")
        return {**data, "precision": "bf16", "float8": data.get("float8", "tensorwise")}
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    epochs: int = Field(1, ge=1)
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="Sequences per process per forward pass; auto = the planner's pick.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seq_len: int = Field(2048, ge=8, description="Tokens per sequence (padded or truncated to this).")
    seed: int = 42
    output_dir: str = "runs/shardtune"
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0 = only before and after training).")
    eval_batches: Annotated[int, Field(ge=1)] | Literal["auto", "all"] | None = Field(
        "auto", description="Cap on eval micro-batches per process; auto = sized to the run (half the training "
                            "micro-batches between two evaluations), all (or null) = the whole held-out set.")
    stop_after_step: int | None = Field(None, ge=1, description="End the run after this step (the LR schedule "
                                                                 "still spans max_steps); resume later.")
    skip_nonfinite: bool = Field(True, description="A NaN or Inf loss / gradient norm skips that optimizer step "
                                                   "(grads zeroed, counted as skipped_steps).")
    max_bad_steps: int = Field(5, ge=1, description="Stop, with a checkpoint of the last good weights, after this "
                                                    "many non-finite steps in a row.")
    loss_spike_factor: float = Field(3.0, ge=0.0, description="Warn once per spike when a step's loss exceeds this "
                                                              "many times the median of the last 50 (0 = off).")


class PeftConfig(_Section):
    method: Literal["none", "lora", "qlora"] = Field("none", description="Full fine-tuning, LoRA, or LoRA on "
                                                                        "4-bit NF4 base weights.")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0.0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["auto", "all-linear"] = Field(
        "auto", description="auto = the architecture's attention + MLP projections; all-linear; or names.")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    offload_embedding: bool | Literal["auto"] = Field(
        "auto", description="Keep the frozen input embedding in host memory and look each micro-batch's rows up "
                            "there (Unsloth's offload_embedding): the table's GPU memory (1 GB on the Llama-3-8B "
                            "shape) for a host gather and a copy of tokens x hidden per micro-batch. One-GPU direct "
                            "path, a plain untied embedding. auto: on there for LoRA / QLoRA on a GPU (8B LoRA on "
                            "one H100: 0.83 GiB less for 0.1-0.4% fewer tokens/s in three calls, QLoRA 0.98 GiB for "
                            "0.9%), off elsewhere; true is refused where it cannot run.")
    offload_head: bool | Literal["auto"] = Field(
        "auto", description="Keep the frozen LM head in host memory and copy it in for each forward, on a side "
                           "stream behind the decoder's kernels; the forward's end drops the GPU copy (Liger's fused "
                           "loss reads the head in forward only; a plain loss frees it once its backward has run). "
                           "The head's GPU memory at the backward's peak (1 GB on the Llama-3-8B shape) for a copy "
                           "of the head per micro-batch over PCIe (8B LoRA at micro-batch 4 on one H100: 0.98 GiB "
                           "lower, 2.1% slower). One-GPU direct path, a plain untied head. auto: off, except that "
                           "parallel.strategy: auto takes it where it is what fits; true is refused where it "
                           "cannot run.")
    base_dtype: Literal["auto", "fp32", "bf16", "fp16", "float8"] = Field(
        "auto", description="Storage dtype of the frozen base weights (NF4 ones excepted): auto = the compute "
                            "precision, as a base loaded for PEFT in bf16, and float8 where that can run; adapters "
                            "keep fp32 masters. float8 (LoRA with train.float8=tensorwise, the base whole on each "
                            "GPU): the adapted layers' weights cast to float8 once after loading, their bf16 copies "
                            "freed (the same numbers as casting them at every pass, less memory and time). bf16 / "
                            "fp16 (the compute precision): cast at every pass.")


class CheckpointConfig(_Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    every_steps: int = Field(0, ge=0, description="Write a resumable checkpoint every N steps (0 = off).")
    every_minutes: float = Field(0.0, ge=0.0, description="... and/or every N minutes of training (0 = off).")
    at_end: bool = Field(True, description="Write a resumable checkpoint after the last step.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep (the newest is never deleted).")
    async_save: bool = Field(False, alias="async", description="Write checkpoints in the background (DCP async).")
    async_writer: Literal["auto", "thread", "process"] = Field(
        "auto", description="Where an async save writes its files: a thread of the training process, or a "
                            "separate process (no GIL shared with training). auto = process on GPUs, thread on CPU.")
    dir: str | None = Field(None, description="Where checkpoints go (default OUTPUT_DIR/checkpoints).")
    resume: str | None = Field(None, description="auto (newest complete checkpoint, if any) or a checkpoint path.")
    save_final: bool = Field(True, description="Write OUTPUT_DIR/model as a Hugging Face directory at the end.")
    save_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto = fp32 for fp32 runs, else bf16.")
    max_shard_size: str = Field("5GB", description="Largest safetensors file of the final model.")

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v


class ProfileConfig(_Section):
    start: int = Field(ge=1, description="First optimizer step to profile (1-based, as metrics.jsonl counts).")
    steps: int = Field(1, ge=1, description="Number of steps to profile.")


class WandbConfig(_Section):
    project: str = Field(description="Weights & Biases project.")
    entity: str | None = Field(None, description="Team or user (default: wandb's own).")
    name: str | None = Field(None, description="Run name (default: the output folder's name).")
    mode: Literal["online", "offline"] = Field("online", description="offline: files under OUTPUT_DIR/wandb only "
                                                                   "(`wandb sync` uploads them later).")


class MlflowConfig(_Section):
    experiment: str = Field(description="MLflow experiment name.")
    tracking_uri: str | None = Field(None, description="Where runs go (default: MLflow's own: MLFLOW_TRACKING_URI "
                                                       "or ./mlruns).")
    run_name: str | None = Field(None, description="Run name (default: the output folder's name).")


class LogConfig(_Section):
    every: int = Field(10, ge=1, description="Log metrics every N optimizer steps (and the last). Each log waits "
                                             "for the GPU to finish its queue: every step cost 1B full fine-tuning "
                                             "on one H200 0.9% of its tokens/s against every 10 (torchtitan's "
                                             "default).")
    progress: bool = Field(True, description="Rich progress bar on rank 0.")
    jsonl: bool = Field(True, description="Write OUTPUT_DIR/metrics.jsonl.")
    system: bool = Field(True, description="Sample GPU utilisation, memory, power and temperature (NVML) or, "
                                           "without NVML, the process's resident set, into metrics.jsonl.")
    comm: bool = Field(True, description="Count the bytes and calls of every collective (comm_<kind>_bytes in "
                                         "metrics.jsonl, `comm` in summary.json); reads tensor sizes only, ~3 us "
                                         "per collective.")
    profile: ProfileConfig | None = Field(None, description="{start: S, steps: K}: torch.profiler trace of steps "
                                                            "S..S+K-1 per rank, OUTPUT_DIR/profile/rankR.json.")
    report: bool = Field(True, description="Write OUTPUT_DIR/report/ (HTML + PNG plots, `shardtune report`) at "
                                           "the end of the run; needs matplotlib.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files to OUTPUT_DIR/tensorboard "
                                                 "(needs the tensorboard package).")
    wandb: WandbConfig | None = Field(None, description="{project: P, ...}: also log to Weights & Biases "
                                                        "(needs wandb).")
    mlflow: MlflowConfig | None = Field(None, description="{experiment: E, ...}: also log to MLflow (needs mlflow).")
    memory_snapshot: list[int] | None = Field(
        None, description="[A, B]: record the CUDA allocator during optimizer steps A..B and write "
                          "OUTPUT_DIR/memory/rankR.pickle (PyTorch's memory viewer) and rankR.txt (the peak and its "
                          "largest allocations); also written on an out-of-memory error inside A..B. CUDA only.")

    @field_validator("memory_snapshot")
    @classmethod
    def _two_steps(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or not 1 <= v[0] <= v[1]):
            raise ValueError("give two optimizer steps [A, B] with 1 <= A <= B, e.g. [3, 4]")
        return v


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    peft: PeftConfig = PeftConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    # Free-form: advanced DeepSpeed keys merged over the config shardtune generates for its DeepSpeed backend
    # (shardtune.parallel.ds_config checks them against the keys it derives itself).
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="Advanced DeepSpeed config keys, merged "
                                                                        "over the generated DeepSpeed config.")

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _deepspeed_keys_and_numbers(cls, v: Any) -> Any:
        _string_keys(v, "deepspeed")
        return _numbers(v)


# Sections with a typed model (one key each; overrides `section.key=value`) ...
SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, _Section)
}
# ... and free-form mappings handed on as they are (overrides `deepspeed.a.b=value` may nest).
FREEFORM_SECTIONS: tuple[str, ...] = tuple(name for name in Config.model_fields if name not in SECTIONS)
ALL_SECTIONS: tuple[str, ...] = tuple(Config.model_fields)

# YAML 1.1 (PyYAML) reads 5e8 and 1e-5 as strings; in a free-form section nothing would convert them later.
_EXP_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _string_keys(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a name; keys are strings such as zero_optimization")
            _string_keys(v, f"{where}.{k}")


def _numbers(value: Any) -> Any:
    """Exponent-notation strings in a free-form section as numbers (integral ones as int: 5e8 -> 500000000)."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _EXP_NUMBER.match(value.strip()):
        number = float(value)
        return int(number) if number.is_integer() and abs(number) < 2**63 else number
    return value

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes (decimal units, as Hugging Face uses; KiB/MiB/GiB are binary)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size like 5GB or 500MB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """['train.lr=1e-4', 'parallel.strategy=zero2'] -> {'train': {'lr': 1e-4}, 'parallel': {...}}.

    Values are parsed as YAML scalars/lists, so `true`, `3`, `[0.9, 0.95]` and `null` work. Free-form
    sections take nested keys: `deepspeed.zero_optimization.reduce_bucket_size=2e8`.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        section = parts[0]
        nested = section in FREEFORM_SECTIONS
        if not sep or len(parts) < 2 or (len(parts) != 2 and not nested) or not all(parts):
            hint = f", e.g. {section}.steps_per_print=10" if nested else ", e.g. train.lr=1e-4"
            raise ConfigError(f"override {item!r}: expected section.key=value{hint}")
        if section not in ALL_SECTIONS:
            raise ConfigError(f"override {item!r}: unknown section {section!r}{_suggest(section, ALL_SECTIONS)}; "
                              f"sections are {', '.join(ALL_SECTIONS)}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out.setdefault(section, {})
        for part in parts[1:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


# Names users bring from HF TrainingArguments, DeepSpeed and accelerate configs.
ALIASES = {
    "learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size", "batch_size": "micro_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size", "gradient_accumulation_steps": "grad_accum",
    "max_seq_length": "seq_len", "max_length": "seq_len", "num_train_epochs": "epochs", "bf16": "precision",
    "fp16": "precision", "mixed_precision": "precision", "gradient_checkpointing": "activation_checkpointing",
    "max_grad_norm": "max_grad_norm", "gradient_clipping": "max_grad_norm", "lr_scheduler_type": "schedule",
    "model_name_or_path": "path", "num_processes": "nproc", "zero_stage": "strategy",
}


def _suggest(word: str, choices: Any) -> str:
    # Match against the keys and the names other tools use for them (a typo of `learning_rate` -> lr).
    names = {c: c for c in choices} | {a: k for a, k in ALIASES.items() if k in choices}
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model that holds the last key of an error location (walking sections and lists)."""
    model: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if _is_model(model) else None
        if field is None:
            return None
        model = field.annotation
        for arg in typing.get_args(model) or ():  # list[SourceConfig], X | None
            if _is_model(arg):
                model = arg
    return model if _is_model(model) else None  # None also inside a free-form mapping (dict[str, Any])


def _is_model(t: Any) -> bool:
    # typing.get_origin: dict[str, Any] is no class on Python 3.11+, a class that issubclass refuses on 3.10.
    return typing.get_origin(t) is None and isinstance(t, type) and issubclass(t, BaseModel)


def _key(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "config"


def _field_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A union field reports each branch as an extra location part (`int`, `bool`, `constrained-int`,
    `literal['auto']`): the key alone."""
    return tuple(part for part in loc if not (isinstance(part, str) and (
        part.startswith(("constrained-", "literal[")) or part in ("int", "bool", "float", "str"))))


def _expected(branch: dict[str, Any]) -> str:
    """What one union branch takes, for the error line."""
    kind = branch["type"]
    if kind == "literal_error":
        return branch.get("ctx", {}).get("expected", "")
    if kind.startswith("bool"):
        return "true, false"
    bounds = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    ctx = branch.get("ctx", {})
    bound = next((f" {sign} {ctx[k]}" for k, sign in bounds.items() if k in ctx), "")
    if kind.startswith(("int", "float", "greater_than", "less_than")):
        number = "an integer" if "int" in str(branch["loc"][-1]) else "a number"  # the branch: int, constrained-int
        return number + bound
    return branch["msg"].lower()


def _one_line(err: ValidationError) -> str:
    """The first error of a pydantic ValidationError as one actionable line."""
    errors = err.errors()
    e = errors[0]
    loc = _field_loc(e["loc"])
    key = _key(loc)
    value = e.get("input")
    kind = e["type"]
    branches = [b for b in errors if _field_loc(b["loc"]) == loc and len(b["loc"]) > len(loc)]
    if len(branches) > 1:  # a union field (`int | "auto"`, `bool | "auto"`): every branch refused the value
        return f"{key}: {value!r} is not valid; use {' or '.join(_expected(b) for b in branches)}"
    if kind == "extra_forbidden":
        model = _model_at(loc)
        allowed = [f.alias or n for n, f in model.model_fields.items()] if model else []
        return f"{key}: unknown key{_suggest(str(loc[-1]), allowed)}; allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "literal_error":
        expected = e.get("ctx", {}).get("expected", "")
        return f"{key}: {value!r} is not allowed; choose one of {expected}"
    if kind == "value_error":
        msg = e["msg"].removeprefix("Value error, ")
        # Model-level checks name their keys themselves; field-level ones get the key in front.
        return msg if len(loc) <= 1 else f"{key}: {msg}"
    return f"{key}: {value!r} is not valid ({e['msg'].lower()})"


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def config_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate a raw mapping (plus dotted overrides) into a Config, or raise ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping of sections (model, data, train, ...)")
    merged = _deep_merge(raw, parse_overrides(overrides))
    for section in FREEFORM_SECTIONS:
        if section in merged and merged[section] is None:  # `deepspeed:` with nothing under it
            del merged[section]
    for section, body in merged.items():
        if section in ALL_SECTIONS and body is not None and not isinstance(body, dict):
            raise ConfigError(f"{section}: must be a mapping of keys, got {body!r}")
    try:
        return Config.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config file and apply `section.key=value` overrides. Raises ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; "
                          "pass the path of a YAML file such as examples/tiny.yaml")
    text = p.read_text()
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), str(p))
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if raw is None:
        raise ConfigError(f"config file {str(p)!r} is empty; it needs at least a model and a data section, as in "
                          "examples/tiny.yaml")
    if isinstance(raw, dict):
        # Paths written in the file mean the same from any folder the command runs in; overrides typed in the
        # shell (applied after this) stay relative to the current directory.
        raw = map_paths(raw, lambda v: v if os.path.isabs(v) or v.startswith("~") else
                        os.path.normpath(os.path.join(p.parent, v)))
    return config_from_dict(raw, overrides)


# Keys that name files or folders, per section. A relative one in a config file is read against the file's folder.
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("path",), "data": ("train_file", "eval_file", "cache_dir", "chat_template"),
    "parallel": ("offload_nvme_path",), "train": ("output_dir",), "checkpoint": ("dir", "resume"),
}


def _is_path(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    if (section, key) == ("checkpoint", "resume"):
        return value != "auto"
    if (section, key) == ("data", "chat_template"):  # else a name: auto, tokenizer, chatml, ...
        return value.endswith(".jinja") or "/" in value
    return True


def map_paths(raw: dict[str, Any], fn: typing.Callable[[str], str]) -> dict[str, Any]:
    """A copy of a raw config mapping with `fn` applied to every path value (PATH_KEYS, data.sources[].path)."""
    out = dict(raw)
    for section, keys in PATH_KEYS.items():
        body = out.get(section)
        if not isinstance(body, dict):
            continue
        body = out[section] = dict(body)
        for key in keys:
            if _is_path(section, key, body.get(key)):
                body[key] = fn(body[key])
        if section == "data" and isinstance(body.get("sources"), list):
            body["sources"] = [{**src, "path": fn(src["path"])} if isinstance(src, dict) and
                               _is_path("data", "path", src.get("path")) else src for src in body["sources"]]
    return out


def _refuse_duplicate_keys(node: yaml.Node | None, path: str, where: str = "", done: set[int] | None = None) -> None:
    """A key given twice in one mapping (a second `train:` section, `lr` twice in one section): PyYAML
    keeps the last silently, so the file would say two things and mean one. Merge keys (<<) may be
    overridden, as YAML intends."""
    done = set() if done is None else done
    if id(node) in done:  # an alias of a node already checked (or of its own parent)
        return
    done.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{where}[{i}]", done)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = f"{where}.{key_node.value}" if where else key_node.value
        line = key_node.start_mark.line + 1
        if key_node.value in seen:
            raise ConfigError(f"config file {path!r}: {key} is given twice (line {seen[key_node.value]} and line "
                              f"{line}); keep one")
        seen[key_node.value] = line
        _refuse_duplicate_keys(value_node, path, key, done)


def dump_config(cfg: Config, *, redact: bool = True) -> str:
    """The resolved config as YAML, every default written out, paths absolute (the file means the same wherever
    it is copied: a run's config.yaml, the Python API's temporary file). `redact`: credentials in URLs (e.g.
    log.mlflow.tracking_uri's user:password@) and secret environment variables' values masked, as the trackers
    get it (shardtune.redact); a file a run reads back must be written with redact=False."""
    raw = map_paths(cfg.model_dump(mode="json", by_alias=True), lambda v: v if v.startswith("~") else
                    os.path.abspath(v))
    if redact:
        from shardtune.redact import redact as mask

        raw = mask(raw)
    return yaml.safe_dump(raw, sort_keys=False)
