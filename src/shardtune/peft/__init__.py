"""Parameter-efficient fine-tuning helpers: 4-bit NF4 base weights (QLoRA) and 8-bit AdamW."""

from __future__ import annotations

import functools

from shardtune.config import OptimConfig, PeftConfig
from shardtune.errors import ShardtuneError


def check(peft: PeftConfig, optim: OptimConfig, precision: str, *, candidate: bool = False,
          float8: str | bool = False) -> None:
    """What the LoRA / QLoRA / 8-bit AdamW settings need, whatever the backend (peft, torchao, a base dtype
    the matmuls can take), refused in one line with the fix. `candidate` (a planner's): the packages are only
    looked up, not imported (peft and torchao import torch and transformers, seconds of a `plan`)."""
    if peft.method != "none" and (failed := _peft_problem(candidate)) is not None:
        raise ShardtuneError(f"peft.method: {peft.method} needs the peft package (import peft failed: {failed}); "
                             f"pip install -e '.[peft]' in the shardtune checkout (or pip install peft), or use "
                             f"peft.method=none")
    if peft.method == "qlora" and not _torchao("nf4", candidate):
        raise ShardtuneError("peft.method: qlora needs torchao (NF4 weights that FSDP2 can shard); "
                             "pip install -e '.[qlora]' in the shardtune checkout")
    if peft.method == "qlora" and peft.use_dora:
        raise ShardtuneError("peft.use_dora: DoRA reads the dequantized base weight, which NF4 weights do not "
                             "offer here; use peft.method=lora with DoRA, or qlora without it")
    if peft.base_dtype == "float8" and peft.use_dora:
        raise ShardtuneError("peft.base_dtype: float8 frees the frozen weights DoRA reads (its weight norm); set "
                             "peft.base_dtype=auto, or peft.use_dora=false")
    if peft.base_dtype == "float8" and (peft.method != "lora" or float8 != "tensorwise"):
        raise ShardtuneError("peft.base_dtype: float8 keeps LoRA's frozen base as the float8 casts of "
                             "train.float8=tensorwise (made once); set peft.method=lora and train.float8=tensorwise, "
                             "or peft.base_dtype=auto")
    if peft.method != "none" and peft.base_dtype not in ("auto", "fp32", "float8", precision):
        raise ShardtuneError(f"peft.base_dtype: {peft.base_dtype} base weights with train.precision={precision} "
                             f"would meet {precision} activations in the matmuls; set peft.base_dtype=auto (or "
                             f"fp32), or train.precision={peft.base_dtype}")
    if optim.name == "adamw8bit" and not _torchao("adamw8bit", candidate):
        raise ShardtuneError("optim.name: adamw8bit needs torchao (its 8-bit AdamW keeps sharded states); "
                             "pip install -e '.[qlora]' in the shardtune checkout")


def keeps_float8_base(peft: PeftConfig, float8: str | bool, *, whole: bool) -> bool:
    """Whether LoRA's frozen float8 layers are kept as their float8 casts, made once, their compute-dtype weights
    freed: peft.base_dtype: float8, or auto where it can be (LoRA, not DoRA, with train.float8=tensorwise and the
    base `whole` on each GPU outside FSDP2). The same numbers as casting the frozen weights at every pass (a
    frozen weight's tensorwise scale never changes; bit for bit on CPU and on an H200), 6.5 GiB less and +7.8%
    on the 8B shape's LoRA step (one H100, bench/RESULTS.md twenty-fifth session): the faster setting that keeps
    parity, so the default of float8 runs. Also the Setting's base_float8 (the planner's copy of this rule)."""
    if peft.base_dtype == "float8":
        return True
    return (peft.base_dtype == "auto" and peft.method == "lora" and not peft.use_dora and float8 == "tensorwise"
            and whole)


def _peft_problem(candidate: bool) -> str | None:
    """Why peft cannot be used (None: it can); for a candidate only whether it is installed."""
    if candidate:
        import importlib.util

        return None if importlib.util.find_spec("peft") is not None else "not installed"
    return peft_import_error()


def _torchao(feature: str, candidate: bool) -> bool:
    if candidate:
        import importlib.util

        return importlib.util.find_spec("torchao") is not None
    if feature == "nf4":
        from shardtune.peft.qlora import nf4_available

        return nf4_available()
    from shardtune.peft.optim8bit import adamw8bit_available

    return adamw8bit_available()


@functools.lru_cache(maxsize=1)
def peft_import_error() -> str | None:
    """None if `import peft` works, else why not (one line): LoRA and QLoRA are built on it, and a worker
    that found it missing would fail only after every process had started."""
    try:
        import peft  # noqa: F401
    except Exception as err:  # ImportError, or a broken install failing in its own way
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}" if first else type(err).__name__
    return None
