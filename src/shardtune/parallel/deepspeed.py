"""DeepSpeed backend: ZeRO-0/1/2/3 with CPU / NVMe offload, behind the same seam as FSDP2.

This module holds what it runs and refuses, free of torch and deepspeed imports (`plan` reads it on a login
node); the engine a run drives is deepspeed_engine.py.

  ddp   -> ZeRO stage 0 (replicas, gradient all-reduce)
  zero1 -> stage 1: optimizer states partitioned
  zero2 -> stage 2: + gradients partitioned (reduce-scatter)
  zero3 -> stage 3: + parameters partitioned, gathered per module for forward and backward

How the engine keeps the loop's conventions and loads the weights: deepspeed_engine.py.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from shardtune.errors import ShardtuneError
from shardtune.parallel.ds_config import STAGES, deepspeed_config
from shardtune.parallel.spec import BackendSpec

if TYPE_CHECKING:
    from shardtune.config import Config, ParallelConfig
    from shardtune.dist import DistContext
    from shardtune.parallel.base import LossFn
    from shardtune.parallel.deepspeed_engine import DeepSpeedBackend


# ---- what this backend runs, and how `plan` describes it --------------------------------------------

SUPPORTS = {
    "parallel.strategy": ("ddp", "zero1", "zero2", "zero3"),
    "parallel.offload": ("none", "optimizer", "params"),
    "peft.method": ("none", "lora"),
    "optim.name": ("adamw",),
    "train.precision": ("fp32", "bf16", "fp16"),  # fp16 on GPUs only (check)
    "parallel.activation_offload": ("false", "true"),
    "parallel.shard_frozen": ("true",),
    "parallel.one_gpu": ("fsdp2",),
    "train.float8": ("false",),
    "parallel.tiled_mlp": ("false", "true"),
}
FLOAT8_REFUSAL = ("train.float8 runs on parallel.backend=fsdp2 (torchao's Float8Linear is not wired into "
                  "DeepSpeed's engine); set parallel.backend=fsdp2, or train.float8=false")
REFUSALS = {
    ("train.float8", "tensorwise"): FLOAT8_REFUSAL,
    ("train.float8", "rowwise"): FLOAT8_REFUSAL,
    ("parallel.strategy", "hsdp"): "parallel.strategy: hsdp (FSDP2's hybrid sharding) needs parallel.backend=fsdp2; "
                                   "set it, or use parallel.strategy=zero3 with deepspeed",
    ("parallel.one_gpu", "direct"): "parallel.one_gpu: direct is FSDP2's one-process path (DeepSpeed runs its own "
                                    "engine); set parallel.backend=fsdp2, or parallel.one_gpu=fsdp2",
    ("parallel.shard_frozen", "false"): "parallel.shard_frozen: false is FSDP2's (DeepSpeed partitions every "
                                        "weight its stage partitions); set parallel.backend=fsdp2, or "
                                        "parallel.shard_frozen=true",
    ("peft.method", "qlora"): "peft.method: qlora needs parallel.backend=fsdp2 (its torchao NF4 weights shard under "
                              "FSDP2 only); set parallel.backend=fsdp2, or use peft.method=lora with deepspeed",
    ("optim.name", "adamw8bit"): "optim.name: adamw8bit needs parallel.backend=fsdp2 (its torchao 8-bit states "
                                 "follow FSDP2's sharded parameters); use optim.name=adamw with deepspeed "
                                 "(parallel.offload=optimizer also saves GPU memory), or parallel.backend=fsdp2",
}


def check(cfg: Config, world: int | None = None, device: str | None = None, *, candidate: bool = False,
          per_node: int | None = None) -> None:
    """DeepSpeed's refusals beyond SUPPORTS. `device` ("cuda"/"cpu"): the machine the run starts on, when known.
    With `world` (every process of the job), also the DeepSpeed config the backend would build, through DeepSpeed's
    own parser (conflicts with the `deepspeed:` section, misspelt keys). A planner's `candidate` is only checked
    for the package being installed: `import deepspeed` is ~5 s of a `plan` that should take one or two, the
    config shardtune builds on its own is one DeepSpeed accepts, and a `deepspeed:` section goes through
    DeepSpeed's parser in `validate` and in the launch (shardtune's merge of it is checked here either way)."""
    p = cfg.parallel
    if cfg.peft.offload_embedding is True:
        raise ShardtuneError("peft.offload_embedding is the FSDP2 backend's one-GPU path; set "
                             "peft.offload_embedding=false, or parallel.backend=fsdp2")
    if cfg.peft.offload_head is True:
        raise ShardtuneError("peft.offload_head is the FSDP2 backend's one-GPU path; set peft.offload_head=false, "
                             "or parallel.backend=fsdp2")
    if cfg.optim.fused == "compiled":
        raise ShardtuneError("optim.fused: compiled is the FSDP2 backend's one-GPU update; DeepSpeed runs its own "
                             "optimizer: set optim.fused=auto, or parallel.backend=fsdp2")
    if device == "cpu" and cfg.train.precision == "fp16":
        raise ShardtuneError("train.precision: DeepSpeed has no fp16 on CPU; use train.precision=bf16 or fp32 here "
                             "(fp16 with deepspeed needs GPUs), or parallel.backend=fsdp2")
    if p.offload_nvme_path is not None and not async_io_available():
        raise ShardtuneError("parallel.offload_nvme_path: NVMe offload needs libaio for DeepSpeed's async I/O op; "
                             "install it (apt-get install libaio-dev, or yum install libaio-devel), or remove "
                             "offload_nvme_path to offload to CPU memory")
    if not cfg.train.skip_nonfinite and p.strategy != "ddp":
        raise ShardtuneError(f"train.skip_nonfinite: false, but DeepSpeed's ZeRO optimizer (parallel.strategy="
                             f"{p.strategy}) always skips a step whose gradients are not finite; remove the setting "
                             "(the default skips and counts such steps), or use parallel.backend=fsdp2")
    if p.strategy == "zero3" and p.compile:
        raise ShardtuneError("parallel.compile: torch.compile is not supported with DeepSpeed zero3 here (its "
                             "parameter gather hooks break the compiled blocks); set parallel.compile=false, or use "
                             "parallel.backend=fsdp2")
    ds = None if world is None else deepspeed_config(p, cfg.train, cfg.optim, cfg.deepspeed, world)  # ConfigError
    if candidate:
        if importlib.util.find_spec("deepspeed") is None:
            raise ShardtuneError(_needs_deepspeed("not installed"))
        return
    failed = deepspeed_import_error()
    if failed is not None:
        raise ShardtuneError(_needs_deepspeed(f"import deepspeed failed: {failed}"))
    if ds is not None:
        check_deepspeed_accepts(ds)


def _needs_deepspeed(why: str) -> str:
    return (f"parallel.backend: deepspeed needs the deepspeed package ({why}); pip install -e '.[deepspeed]' in the "
            "shardtune checkout, or use parallel.backend=fsdp2")


def describe(cfg: Config, world: int, *, per_node: int | None = None) -> str:
    return f"DeepSpeed ZeRO stage {STAGES[cfg.parallel.strategy]}"


def check_deepspeed_accepts(ds: dict[str, Any]) -> None:
    """DeepSpeed's own config parser on the merged config, so a misspelt key of the `deepspeed:` section stops
    the run here and not after every process has started."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    # Outside a process group DeepSpeedConfig checks the batch sizes against a world of 1.
    probe = {**ds, "train_batch_size": ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            DeepSpeedConfig(probe)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(part) for part in e["loc"]) or "config"
        raise ShardtuneError(f"deepspeed: DeepSpeed refuses the config ({err.title}): {where}: {e['msg']}; fix or "
                             "remove it in the deepspeed section") from None
    except (AssertionError, ValueError, TypeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ShardtuneError(f"deepspeed: DeepSpeed refuses the config: {first}; fix it in the deepspeed section") \
            from None


@functools.lru_cache(maxsize=1)
def deepspeed_import_error() -> str | None:
    """None if `import deepspeed` works, else why not (one line).

    DeepSpeed's logger writes to stdout, and its accelerator probe logs while importing ("Setting accelerator
    to CPU" on machines without a GPU). That chatter is dropped and the logger pointed at stderr, so stdout stays
    for what shardtune prints there (`shardtune plan --emit ...`) and a refused config stays one line."""
    import io
    import logging

    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter):
            import deepspeed  # noqa: F401
    except Exception as err:  # a broken install fails in many ways (ImportError, RuntimeError from an op builder)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}" if first else type(err).__name__
    finally:
        for handler in logging.getLogger("DeepSpeed").handlers:  # the handler DeepSpeed made during this import
            if isinstance(handler, logging.StreamHandler) and handler.stream is chatter:
                handler.setStream(sys.stderr)
    return None


def async_io_available() -> bool:
    """Whether DeepSpeed's async I/O op (NVMe offload) can be built here: it needs libaio."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # deepspeed missing or its probe failing: the import check reports the former
        return False


def param_shards(parallel: ParallelConfig, world: int) -> int:
    """Only ZeRO-3 partitions the parameters."""
    return world if STAGES[parallel.strategy] == 3 else 1



def _make(cfg: Config, ctx: DistContext, loss: LossFn) -> DeepSpeedBackend:
    from shardtune.parallel.deepspeed_engine import DeepSpeedBackend

    ds = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, ctx.world)
    return DeepSpeedBackend(cfg.parallel, cfg.train.precision, ctx, ds, loss)


SPEC = BackendSpec(supports=SUPPORTS, refusals=REFUSALS, make=_make, check=check, describe=describe,
                   checkpoint_format="deepspeed", param_shards=param_shards)
