"""Backends behind one seam (see base.Backend). The loop never asks which one it has.

Each backend module declares what it runs (SUPPORTS, REFUSALS), its other refusals (`check`), how
`plan` describes it (`describe`) and its checkpoint format, in one BackendSpec; BACKENDS maps
`parallel.backend` to it. Nothing outside this package asks which backend or strategy a run has.
The rules (this module, spec.py, fsdp2.py, deepspeed.py, ds_config.py) import neither torch nor deepspeed, so
`plan` and `validate` run on a login node without them; a backend's engine module is imported by `make` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.errors import ShardtuneError
from shardtune.parallel import deepspeed, fsdp2
from shardtune.parallel.spec import BackendSpec

if TYPE_CHECKING:
    from shardtune.config import Config, ParallelConfig
    from shardtune.dist import DistContext
    from shardtune.parallel.base import Backend, LossFn

BACKENDS: dict[str, BackendSpec] = {
    "fsdp2": fsdp2.SPEC,
    "deepspeed": deepspeed.SPEC,
}


def make_backend(cfg: Config, ctx: DistContext, loss: LossFn) -> Backend:
    """The run's backend, computing `loss` (logits, labels) -> the sum of token losses."""
    return BACKENDS[cfg.parallel.backend].make(cfg, ctx, loss)


def check_combination(cfg: Config, world: int | None = None, *, device: str | None = None,
                      candidate: bool = False, nnodes: int = 1) -> None:
    """Settings that cannot work together, refused before any process starts: the backend's refusals (check)
    and what the PEFT / optimizer settings need (peft.check). With `world` (processes per node, on `nnodes`
    nodes), also hsdp's groups and the DeepSpeed config the deepspeed backend would build (conflicts with the
    `deepspeed:` section); with `device` ("cuda" or "cpu"), what the machine cannot run. `candidate`: a planner's
    candidate, checked only as far as it can be without importing an installed backend package (the run that
    takes it is checked in full)."""
    from shardtune import peft

    check(cfg, world, device, candidate=candidate, nnodes=nnodes)
    peft.check(cfg.peft, cfg.optim, cfg.train.precision, candidate=candidate, float8=cfg.train.float8)


def check(cfg: Config, world: int | None = None, device: str | None = None, *, candidate: bool = False,
          nnodes: int = 1) -> None:
    """Refuse, in one line with its fix, what the chosen backend cannot run: first the settings it does not
    support, then the strategy and offload settings that contradict each other on any backend, then the
    backend's own checks. `world`: processes per node (None: not known, as for a planner's candidate), on
    `nnodes` nodes; `device`: "cuda" or "cpu", the machine the run starts on (None: not known)."""
    spec = BACKENDS[cfg.parallel.backend]
    spec.refuse_unsupported(cfg)
    check_strategy(cfg.parallel)
    check_cudagraphs(cfg.parallel)
    check_checkpoint_in_compile(cfg.parallel)
    spec.check(cfg, None if world is None else world * nnodes, device, candidate=candidate, per_node=world)


def describe(cfg: Config, world: int, *, nnodes: int = 1) -> str:
    """How the chosen backend runs the strategy on `world` processes per node of `nnodes` nodes (`shardtune
    plan`)."""
    return BACKENDS[cfg.parallel.backend].describe(cfg, world * nnodes, per_node=world)


def memory_fixes(p: ParallelConfig, world: int) -> list[str]:
    """Overrides that lower a run's peak GPU memory at the parallel level, smallest change first (for the
    out-of-memory message): activation checkpointing, then sharding parameters too."""
    fixes = ["parallel.activation_checkpointing=full"] if p.activation_checkpointing != "full" else []
    if p.strategy in ("ddp", "zero1", "zero2") and world > 1:
        fixes.append("parallel.strategy=zero3")
    return fixes


def host_memory_fixes(cfg: Config, gpus: int) -> list[str]:
    """Overrides that lower a run's host (CPU) memory, for the line after the kernel's out-of-memory killer ended
    a worker: what this config keeps in host memory first, then the generic ones."""
    t, p = cfg.train, cfg.parallel
    fixes = []
    if p.offload != "none":
        fixes.append(f"parallel.offload=none or parallel.offload_nvme_path=DIR ({p.offload} states are held in host "
                     "memory)" if p.offload_nvme_path is None else "parallel.offload=none")
    if cfg.checkpoint.async_save:
        fixes.append("checkpoint.async=false (its buffers hold a host copy of every rank's shards)")
    if not gpus and isinstance(t.micro_batch_size, int) and t.micro_batch_size > 1:  # on CPU, activations too
        fixes.append(f"train.micro_batch_size={t.micro_batch_size // 2} train.grad_accum={t.grad_accum * 2}")
    return [*fixes, "fewer processes on this node (--nproc)", "a node with more memory"]


def uses_cudagraphs(parallel: ParallelConfig) -> bool:
    """Whether the compiled blocks replay CUDA graphs (compile_mode reduce-overhead / max-autotune, or Inductor's
    triton.cudagraphs option): the loop then marks each micro-batch's start for CUDA graph trees, whose outputs
    are overwritten by the next replay (torch.compiler.cudagraph_mark_step_begin)."""
    if not parallel.compile:
        return False
    options = parallel.compile_options or {}
    return parallel.compile_mode in ("reduce-overhead", "max-autotune") or bool(options.get("triton.cudagraphs"))


def checkpoint_traced(p: ParallelConfig) -> bool:
    """Whether compile traces each block's checkpoint (parallel/prepare.CheckpointedForward): see traces_checkpoint."""
    return traces_checkpoint(p.compile, p.activation_checkpointing, p.checkpoint_in_compile, long_sequence(p))


def long_sequence(p: ParallelConfig | Any) -> bool:
    """Settings made for sequences too long for the GPU (activation_offload, tiled_mlp), under which
    checkpoint_in_compile's auto keeps the checkpoint around the compiled blocks (traces_checkpoint). `p`: the
    config's parallel section, or the planner's Setting (the same two fields)."""
    return p.activation_offload or p.tiled_mlp is not None


def traces_checkpoint(compiled: bool, checkpointing: str, in_compile: bool | str, long_sequence: bool) -> bool:
    """Whether compile traces each block's checkpoint: always for selective checkpointing, whose per-op policy sees
    the ops only while Dynamo traces them (around a compiled block it would see Inductor's kernels, match no matmul,
    and recompute everything, as full does); for full with parallel.checkpoint_in_compile true, or auto without
    `long_sequence` (activation_offload or tiled_mlp). The offload is for sequences too long for the GPU, where the
    inside recompute's backward would hold about 3.5 x p x f bytes per token more (plan/memory.py INSIDE_RECOMPUTE:
    12.5 GiB measured at 131,072 tokens of the 8B shape, 31 GiB at 327,680), so auto keeps the checkpoint around
    there; true runs both (the offload's hooks also take the block inputs the compiled code saves). The tiled MLP
    runs outside the compiled graph, so inside is refused with it (config). Shared with the planner's Setting,
    whose search varies the checkpointing and the offload."""
    if not compiled or checkpointing == "none":
        return False
    if checkpointing == "selective":
        return True
    return in_compile is True or (in_compile == "auto" and not long_sequence)


def check_checkpoint_in_compile(p: ParallelConfig) -> None:
    """Selective checkpointing under compile is traced, so the offload's hooks would take every output it keeps
    (the compiled code's saved tensors), not the block inputs alone that the planner prices and the tests cover:
    refused. Full checkpointing traced (checkpoint_in_compile true) runs with the offload."""
    if p.compile and p.activation_checkpointing == "selective" and p.activation_offload:
        raise ShardtuneError("parallel.activation_checkpointing=selective with parallel.compile: "
                             "parallel.activation_offload is not built for it (it would move every output selective "
                             "keeps, not the block inputs); use activation_checkpointing=full with the offload, or "
                             "activation_offload=false")


def cudagraphs_rule_out_checkpointing(p: ParallelConfig) -> bool:
    """CUDA graph trees fail in a recompute run from Python (check_cudagraphs): whether full checkpointing would
    run one with these settings (the checkpoint around the compiled blocks)."""
    return uses_cudagraphs(p) and not traces_checkpoint(p.compile, "full", p.checkpoint_in_compile, long_sequence(p))


TIED_EMBEDDING = ("peft.offload_embedding: this model ties its input embedding to the LM head (tie_word_embeddings), "
                  "which computes on the GPU; set peft.offload_embedding=false")


def check_weights_on_host(cfg: Config, hf_config: Any) -> None:
    """peft.offload_embedding and peft.offload_head need an input embedding and an LM head of their own: refused
    before launch from the model's config (parallel/host_embedding.py and host_head.py check the modules too)."""
    tied = getattr(hf_config, "tie_word_embeddings", False)
    if cfg.peft.offload_embedding is True and tied:
        raise ShardtuneError(TIED_EMBEDDING)
    if cfg.peft.offload_head is True and tied:
        from shardtune.parallel.host_head import TIED_HEAD

        raise ShardtuneError(TIED_HEAD)


def check_direct_only(cfg: Config, world: int) -> None:
    """Refusals that hold whatever `parallel.strategy: auto` would pick (the planner's "nothing fits" names them
    instead): what only FSDP2's one-GPU direct path runs, asked for on more than one process."""
    if cfg.parallel.backend == "fsdp2":
        fsdp2.check_direct_only(cfg, world)


def check_cudagraphs(p: ParallelConfig) -> None:
    """CUDA graph trees under activation checkpointing: the recompute in backward keeps a graph's input alive
    that died while it was recorded, and torch stops the run in the first backward ("graph recording observed an
    input tensor deallocate during graph recording that did not occur during replay", pytorch/pytorch#154306;
    8B LoRA with full checkpointing on an H100, bench/RESULTS.md twenty-sixth session). With the checkpoint inside
    the graph they ran; not with activation_offload too (the graphs' outputs live in their own memory pool,
    which the offload's copies were never run against). Refused before launch."""
    if not uses_cudagraphs(p):
        return
    what = (f"parallel.compile_mode={p.compile_mode}" if p.compile_mode != "default"
            else "parallel.compile_options triton.cudagraphs")
    if p.activation_checkpointing != "none" and not checkpoint_traced(p):
        raise ShardtuneError(f"{what}: CUDA graphs fail in the recompute of activation_checkpointing "
                             f"{p.activation_checkpointing} (pytorch/pytorch#154306); use parallel.compile_mode="
                             "default or max-autotune-no-cudagraphs, parallel.activation_checkpointing=none, or "
                             "parallel.checkpoint_in_compile auto or true without activation_offload (the "
                             "recompute inside the graph: it ran on an H100)")
    if p.activation_offload:
        raise ShardtuneError(f"{what}: CUDA graphs with parallel.activation_offload are not supported (never run "
                             "together); use parallel.compile_mode=default or max-autotune-no-cudagraphs, or "
                             "activation_offload=false")


def check_strategy(p: ParallelConfig) -> None:
    """Strategy, offload and NVMe settings that contradict each other whatever the backend."""
    if p.shard_size != "auto" and p.strategy != "hsdp":
        raise ShardtuneError(f"parallel.shard_size: set, but parallel.strategy is {p.strategy} (only hsdp shards "
                             "within groups); set parallel.strategy=hsdp, or remove shard_size")
    if p.offload == "params" and p.strategy != "zero3":
        raise ShardtuneError(f"parallel.offload: params offloads parameters, which only zero3 partitions (strategy is "
                             f"{p.strategy}); set parallel.strategy=zero3, or parallel.offload=optimizer")
    if p.offload == "optimizer" and p.strategy == "ddp":
        raise ShardtuneError("parallel.offload: optimizer offload moves sharded optimizer states, and ddp shards "
                             "none; set parallel.strategy=zero1, zero2 or zero3, or parallel.offload=none")
    if p.offload_nvme_path is None:
        return
    if p.offload == "none":
        raise ShardtuneError("parallel.offload_nvme_path: set, but parallel.offload is none (nothing to put "
                             "there); set parallel.offload=optimizer or params, or remove offload_nvme_path")
    if p.strategy != "zero3":
        raise ShardtuneError(f"parallel.offload_nvme_path: NVMe offload needs parallel.strategy=zero3 (DeepSpeed's "
                             f"{p.strategy} would keep the states in CPU memory instead); set "
                             "parallel.strategy=zero3, or remove offload_nvme_path to offload to CPU memory")
    if not Path(p.offload_nvme_path).is_dir():
        what = "is not a folder" if Path(p.offload_nvme_path).exists() else "does not exist"
        raise ShardtuneError(f"parallel.offload_nvme_path: {p.offload_nvme_path!r} {what}; create the folder "
                             "on a local NVMe drive, or fix the path")
