"""When Liger applies (models/liger.py has the kernels and the fused loss): the model types, the refusals and
the choice, without torch, so `plan` reads them on a login node without the import."""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

from shardtune.errors import ShardtuneError

# Model types whose causal-LM module is `model` (the decoder) + `lm_head` with a plain final projection (no
# logit soft-capping), and which Liger patches (liger_kernel.transformers.monkey_patch).
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LigerSetting = bool | Literal["auto", "loss"]


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def head_adapted(method: str, targets: object) -> bool:
    """peft.target_modules puts a LoRA adapter on the LM head (`lm_head`, the head of every LIGER_MODEL_TYPES
    model). Liger's fused loss multiplies by the head's weight alone: it would skip the adapter, whose gradient
    would stay zero and whose export would hold an untrained head adapter. Such runs keep the plain loss."""
    return method != "none" and isinstance(targets, list) and any(str(t).rsplit(".", 1)[-1] == "lm_head"
                                                                  for t in targets)


def check_liger(setting: LigerSetting, device_type: str, model_type: str, *, adapted_head: bool = False) -> None:
    """Refuse `model.liger: true` where it cannot run, in one line with the fix (auto and false never are).
    `adapted_head`: head_adapted for the run's peft section."""
    if setting is not True and setting != "loss":
        return
    key = "true" if setting is True else setting
    if setting == "loss" and adapted_head:
        raise ShardtuneError("model.liger: loss computes the loss from the LM head's weight alone, and "
                             "peft.target_modules puts a LoRA adapter on lm_head, which it would skip; remove "
                             "lm_head from peft.target_modules, or set model.liger=auto (the loss then stays plain)")
    if device_type != "cuda":
        raise ShardtuneError(f"model.liger: {key} needs CUDA GPUs (Liger's kernels are Triton) and this machine has "
                             f"{device_type} only; set model.liger=auto (on only on GPUs) or false")
    if model_type not in LIGER_MODEL_TYPES:
        raise ShardtuneError(f"model.liger: {key}, but shardtune applies Liger only to {', '.join(LIGER_MODEL_TYPES)} "
                             f"models and this one is {model_type!r}; set model.liger=false")
    if not liger_installed():
        raise ShardtuneError(f"model.liger: {key}, but liger-kernel is not installed; pip install -e '.[liger]' "
                             "(or liger-kernel), or set model.liger=auto or false")


def use_liger(setting: LigerSetting, device_type: str, model_type: str) -> bool:
    """Whether this run applies Liger (after check_liger passed)."""
    if setting is False:
        return False
    return device_type == "cuda" and model_type in LIGER_MODEL_TYPES and liger_installed()


def liger_kernels_wanted(setting: LigerSetting, compiled: bool) -> bool:
    """Whether Liger's RMSNorm, RoPE and SwiGLU go in (where use_liger holds): always for true, never for loss;
    for auto only without parallel.compile (bench/RESULTS.md 2026-12-02: with compiled blocks they cost speed)."""
    return setting is True or (setting == "auto" and not compiled)


def auto_would_take(setting: LigerSetting, device_type: str, model_type: str, *, compiled: bool,
                    adapted_head: bool) -> bool:
    """Whether model.liger: auto takes anything of Liger's on this run once liger-kernel is installed: its kernels
    (without parallel.compile: liger_kernels_wanted) or its fused loss (where the LM head has no adapter:
    head_adapted). The run's start line and `shardtune plan` ask it where liger-kernel is missing, so both say
    "install it" for the same runs."""
    if setting != "auto" or device_type != "cuda" or model_type not in LIGER_MODEL_TYPES:
        return False
    return liger_kernels_wanted(setting, compiled) or not adapted_head


def chunk_tokens(setting: int | str) -> int:
    """model.liger_chunk resolved: auto = 1024 tokens (at least Liger's own chunk: fused_loss_chunk), for every
    method. Full fine-tuning reads and writes the LM head's fp32 gradient once per chunk (1B, one H200: +14%);
    with the head frozen (LoRA / QLoRA) each chunk still reads the whole head twice in a small-row matmul (8B
    LoRA, one H200: +2.4% under FSDP2 in call 48, +2.3% direct in call 53, at the same peak)."""
    return 1024 if setting == "auto" else int(setting)


def _liger_chunk_rows(tokens: int, vocab: int, hidden: int, mem_const: int) -> int:
    """The rows per chunk Liger's fused linear + cross-entropy takes for `chunk_mem_const` (its own formula,
    liger_kernel/ops/fused_linear_cross_entropy.py): next_pow2(ceil(tokens / ceil(vocab / (C x hidden))))."""
    inc = -(-vocab // (mem_const * hidden))
    return min(1 << max(0, (-(-tokens // inc) - 1).bit_length()), tokens)


@functools.lru_cache(maxsize=64)  # the fused loss asks once per micro-batch, always the same few shapes
def fused_loss_chunk(tokens: int, vocab: int, hidden: int, rows: int) -> tuple[int, int]:
    """(Liger's chunk_mem_const, the rows per chunk it gives) for `model.liger_chunk` = `rows`: the largest
    constant whose chunk is at most max(rows, Liger's own chunk); rows 0 keeps Liger's own (constant 1).
    Liger's own chunk at Llama-3 1B, micro-batch 4 (8,192 tokens) is 256 rows, so 32 chunks a step, each
    reading and writing the LM head's fp32 gradient (1 GB) in its own small-K matmul: 26 ms of a 155 ms step
    on one H200 (bench/RESULTS.md, 2026-12-04 seventeenth session)."""
    own = _liger_chunk_rows(tokens, vocab, hidden, 1)
    const = 1
    if rows > 0:
        for c in range(2, -(-vocab // hidden) + 1):
            if _liger_chunk_rows(tokens, vocab, hidden, c) > max(rows, own):
                break
            const = c
    return const, _liger_chunk_rows(tokens, vocab, hidden, const)
