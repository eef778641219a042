"""The one training loop. Full fine-tuning under every strategy goes through here; the backend,
model source and data are the pieces plugged in."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune import stop as signals
from shardtune.assemble import BuiltModel, assemble, load_kept
from shardtune.checkpoint.checkpointer import Checkpointer, check_shared_root
from shardtune.checkpoint.formats import make_format
from shardtune.checkpoint.hf_export import SAVE_DTYPES, save_adapter, save_hf_model
from shardtune.checkpoint.layout import (
    VERIFIED_ENV,
    checkpoint_root,
    complete_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
)
from shardtune.checkpoint.outdir import check_final_dir
from shardtune.checkpoint.runlock import lock_run_dir
from shardtune.config import Config, TrainConfig, dump_config, parse_size
from shardtune.data import Batch, StepSampler, eval_batches, eval_num_batches, to_device
from shardtune.data.pipeline import DataBundle, build_data, skipped_line
from shardtune.dist import DistContext, HostCopy, all_gather_floats, all_reduce_sum, init_distributed
from shardtune.errors import ShardtuneError
from shardtune.fileio import jsonable
from shardtune.metrics import comm
from shardtune.metrics.flops import flops_per_token, matmul_params, mfu, peak_flops
from shardtune.metrics.logger import MetricsLogger, log_rank0
from shardtune.metrics.memory_snapshot import MemorySnapshot
from shardtune.metrics.profile import StepProfiler
from shardtune.metrics.system import SystemSampler
from shardtune.models.build import load_hf_config, write_config
from shardtune.models.liger_rules import auto_would_take, head_adapted, liger_kernels_wanted, use_liger
from shardtune.models.tokenizer import check_vocab, load_tokenizer
from shardtune.parallel import BACKENDS, make_backend, memory_fixes, uses_cudagraphs
from shardtune.parallel.base import Backend
from shardtune.peft import keeps_float8_base
from shardtune.redact import redact
from shardtune.runtime import GcClock, collect_between_steps
from shardtune.train.loss import exact_match, token_loss_sum
from shardtune.train.optim import OptimizerFactory, build_scheduler, current_lr

SPIKE_WINDOW = 50  # steps whose median loss a spike is measured against
# Test-only fault injection: steps (1-based, comma-separated) whose loss is multiplied by NaN on every rank.
TEST_NAN_ENV = "SHARDTUNE_TEST_NAN_STEPS"
# Tests only: raise torch.OutOfMemoryError at the start of this step (CPU runs cannot run out of GPU memory).
TEST_OOM_ENV = "SHARDTUNE_TEST_OOM_STEP"
# Tests only: "RANK:STEP": that rank SIGKILLs itself at the start of that step, as the kernel's out-of-memory killer
# would.
TEST_SIGKILL_ENV = "SHARDTUNE_TEST_SIGKILL"


@dataclass
class RunState:
    """What the loop carries between steps."""

    step: int = 0
    stopped_by: int = 0  # the stop signal (SIGTERM, SIGINT) the ranks agreed to stop at, 0 if none
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # steps whose update was skipped for a non-finite loss / grad norm, over the whole run
    bad_in_row: int = 0  # ... of them in a row, up to this step
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))  # rank 0's step losses
    in_spike: bool = False
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # rank 0's collectives over the counted steps
    comm_steps: int = 0


@dataclass
class TrainResult:
    summary: dict[str, Any]  # what summary.json holds
    backend: Backend  # the trained, still sharded model and its optimizer (for in-process callers)


@dataclass
class Run:
    """What set_up hands the step loop: the pieces plugged in, and where the run stands."""

    cfg: Config
    ctx: DistContext
    out: Path
    hf_config: Any
    tokenizer: Any
    data: DataBundle
    sampler: StepSampler
    built: BuiltModel
    backend: Backend
    schedule: torch.optim.lr_scheduler.LRScheduler  # the LR of backend.optimizer, stepped with every update
    ckpt: Checkpointer
    logger: MetricsLogger
    total_steps: int
    stop: int  # the step this launch ends at (train.stop_after_step, else total_steps)
    predicted: dict[str, Any] | None  # the planner's prediction (plan.json), compared with the run at the end
    resume: Path | None
    state: RunState
    flops_per_token: float
    peak_flops: float | None
    profiler: StepProfiler | None = None  # log.profile
    saved_config: dict[str, Any] = field(default_factory=dict)  # the config as checkpoints record it (trainer_state)
    cudagraphs: bool = False  # the compiled blocks replay CUDA graphs (parallel.compile_mode / compile_options)
    pending: _Pending | None = None  # the last step, until the loop has read its outcome
    memory: MemorySnapshot | None = None  # log.memory_snapshot
    system: SystemSampler | None = None  # log.system, rank 0


def run_training(cfg: Config, ctx: DistContext | None = None, *, overwrite: bool = False) -> TrainResult:
    """Train as `cfg` says on the current process group; every rank gets the result. `overwrite`
    (train --overwrite) lets the run replace a final model/adapter folder that shardtune did not write."""
    check_final_dir(cfg, overwrite)  # also here: torchrun may start the workers without `validate`
    signals.install()  # SIGTERM/SIGINT: finish the step, save, stop; SIGUSR1: save and go on
    try:
        with comm.counting(comm.CommCounter()) if cfg.log.comm else contextlib.nullcontext():
            return _run(cfg, ctx, overwrite)
    finally:
        signals.uninstall()


def _run(cfg: Config, ctx: DistContext | None, overwrite: bool) -> TrainResult:
    ctx = ctx or init_distributed()
    if ctx.is_main:  # a no-op under `shardtune train`, whose launcher holds it; torchrun started us directly
        lock_run_dir(Path(cfg.train.output_dir))
    # Several nodes: one checkpoint folder for all, checked before the model is built.
    check_shared_root(checkpoint_root(cfg.checkpoint, cfg.train.output_dir), ctx,
                      int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world)))
    try:
        run = set_up(cfg, ctx)
    except torch.OutOfMemoryError as err:
        raise out_of_memory(cfg, ctx, err, "while building and loading the model") from None
    run_eval = _evaluator(run.backend, run.data, run.cfg, run.ctx, run.logger, run.state, run.total_steps)
    start = time.perf_counter()
    if not run.resume:
        _no_oom(run, "in the evaluation before step 1", run_eval, 0)
    interval = _Interval(run.ctx.device, run.system)
    with collect_between_steps() as interval.gc:  # no GC pass inside a step (full ones stalled checkpoint saves)
        interval.t0 = time.perf_counter()  # the first interval leaves out the collection before the loop
        for step in range(run.state.step, run.stop):
            _no_oom(run, f"in step {step + 1}", _train_step, run, step, interval)
            interval.gc.collect()  # while the GPU runs the step just queued, where nothing made the host wait
            if run.state.stopped_by or run.state.bad_in_row >= run.cfg.train.max_bad_steps:
                break
            if run.cfg.train.eval_every and run.state.step % run.cfg.train.eval_every == 0 \
                    and run.state.step != run.total_steps:
                interval.eval_s += _no_oom(run, f"in the evaluation after step {run.state.step}", _timed, run_eval,
                                           run.state.step, device=run.ctx.device)
        if run.pending is not None:  # read at the last step already (its log is due); kept for safety
            _settle(run, interval)
        run.ckpt.close()
    if run.profiler is not None:
        run.profiler.close()  # a run that stopped inside the profiled steps still writes its trace
    if run.memory is not None:
        run.memory.close("the run ended first")
    if run.state.bad_in_row >= run.cfg.train.max_bad_steps:
        run.logger.close()
        saved = run.ckpt.root / f"step-{run.state.step:08d}"  # written whatever the checkpoint settings
        raise ShardtuneError(f"step {run.state.step}: {run.state.bad_in_row} steps in a row had a non-finite loss or "
                             f"gradient norm (train.max_bad_steps={run.cfg.train.max_bad_steps}); stopped with the "
                             f"last good weights in {saved}; lower train.lr or check the data, then --resume auto")
    finished = run.state.step >= run.total_steps
    if finished:
        _no_oom(run, "in the final evaluation", run_eval, run.total_steps)
    return finish(run, finished, time.perf_counter() - start, overwrite=overwrite)


def _no_oom(run: Run, where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs); out of GPU memory, the one-line error that says where and what fits, with the
    memory snapshot written when log.memory_snapshot is recording (a step or an evaluation inside A..B)."""
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError as err:
        written = run.memory.close("out of memory") if run.memory is not None else []
        raise out_of_memory(run.cfg, run.ctx, err, where, written) from None


def out_of_memory(cfg: Config, ctx: DistContext, err: BaseException, where: str,
                  snapshot: list[Path] | None = None) -> ShardtuneError:
    """A CUDA out-of-memory error as one line: where it happened, what the GPU held, and the smallest changes that
    lower the peak (the planner's fixes, in its order), instead of a traceback from every rank. `snapshot`: the
    memory snapshot files log.memory_snapshot wrote up to the error."""
    held = ""
    if ctx.device.type == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
        held = (f" ({torch.cuda.memory_allocated(ctx.device) / 2**30:.1f} GiB allocated, "
                f"{torch.cuda.memory_reserved(ctx.device) / 2**30:.1f} GiB reserved of {total:.1f} GiB)")
    t, p = cfg.train, cfg.parallel
    fixes: list[str] = []
    if isinstance(t.micro_batch_size, int) and t.micro_batch_size > 1:
        fixes.append(f"train.micro_batch_size={t.micro_batch_size // 2} train.grad_accum={t.grad_accum * 2} "
                     "(the same global batch)")
    fixes += memory_fixes(p, ctx.world)
    first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    seen = f"; allocations up to it: {snapshot[-1]}" if snapshot else ""
    return ShardtuneError(f"out of GPU memory {where} on rank {ctx.rank}{held}: {first}; this setting does not fit: "
                          f"`shardtune plan CONFIG --all` shows what fits; try {'; or '.join(fixes) or 'more GPUs'}"
                          f"{seen}")


def set_up(cfg: Config, ctx: DistContext) -> Run:
    """Everything before the first step: config (kept global batch on resume), data, model, backend, checkpointer
    (and the checkpoint loaded), logger."""
    torch.manual_seed(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    root = checkpoint_root(cfg.checkpoint, out)
    hf_config = load_hf_config(cfg.model)
    cfg = resolve_plan_auto(cfg, hf_config, ctx)
    resume = resume_point(cfg, root, ctx)
    if resume:
        cfg = keep_global_batch(cfg, read_trainer_state(resume), ctx)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_config(cfg))
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    check_vocab(tokenizer, hf_config)
    t = cfg.train
    data = build_data(cfg.data, tokenizer, t.seq_len, t.seed, builder=ctx.local_rank == 0)
    sampler = StepSampler(len(data.train), t.micro_batch_size, t.grad_accum, ctx.world, ctx.rank, t.seed)
    total_steps = t.max_steps or sampler.steps_per_epoch * t.epochs

    spec = BACKENDS[cfg.parallel.backend]
    liger = use_liger(cfg.model.liger, ctx.device.type, hf_config.model_type)
    kernels = liger and liger_kernels_wanted(cfg.model.liger, cfg.parallel.compile)
    whole = spec.keeps_float8_base(cfg.parallel, ctx.world)
    built = assemble(cfg.model, cfg.peft, t.precision, hf_config, ctx.device,
                     spec.param_shards(cfg.parallel, ctx.world), liger_kernels=kernels, float8=t.float8 or None,
                     keep_float8_base=keeps_float8_base(cfg.peft, t.float8, whole=whole))
    if built.adapters:  # checkpoints (hf/adapter_config.json) and the final adapter name a loadable base
        from shardtune.peft.lora import adapter_base

        built.model.peft_config["default"].base_model_name_or_path = adapter_base(cfg.model)[0]
    backend = make_backend(cfg, ctx, _with_test_nan(token_loss_sum))
    if liger:
        _liger_loss(cfg, ctx, built, backend, kernels)
    elif auto_would_take(cfg.model.liger, ctx.device.type, hf_config.model_type, compiled=cfg.parallel.compile,
                         adapted_head=head_adapted(cfg.peft.method, cfg.peft.target_modules)):
        log_rank0(ctx.rank, "liger: liger-kernel is not installed; pip install liger-kernel (or -e '.[liger]' in the "
                            "checkout) and model.liger: auto takes its fused loss or kernels (`shardtune plan` prices "
                            "them)")
    if t.float8:
        eager_lora = built.adapters and not cfg.parallel.compile and not built.kept
        could_keep = keeps_float8_base(cfg.peft.model_copy(update={"base_dtype": "auto"}), t.float8, whole=whole)
        log_rank0(ctx.rank, f"float8 ({t.float8}): {built.float8_layers} linear layers" + (
            "; without parallel.compile the frozen layers' weight gradients are computed and dropped each step "
            "(set parallel.compile=true" + (", or peft.base_dtype=auto" if could_keep else "") + ")"
            if eager_lora else ""))
    if hasattr(backend, "skip_nonfinite"):
        backend.skip_nonfinite = t.skip_nonfinite
    # Resuming full fine-tuning: the checkpoint overwrites every parameter, so the initial weights
    # are not read. With adapters the checkpoint holds only them: the base is read again.
    weights = None if resume and not built.adapters else built.source
    backend.setup(built.model, built.blocks, weights, OptimizerFactory(cfg.optim, t.lr))
    if built.kept:  # the frozen float8 layers, loaded one at a time and kept as their float8 casts
        _load_kept(built, weights, ctx)
    schedule = build_scheduler(backend.optimizer, cfg.optim, total_steps)
    dtype = SAVE_DTYPES[save_dtype(cfg)]
    ckpt = Checkpointer(cfg.checkpoint, root, ctx, lambda path: write_hf_dir(path, built, hf_config, tokenizer, dtype),
                        make_format(spec.checkpoint_format))
    if resume:
        saved = ckpt.load(resume, backend)
        schedule.load_state_dict(saved["extra"]["scheduler"])
        backend.load_extra_state(saved["extra"])
        sampler.load_state_dict(saved["sampler"])
        skipped = int(saved.get("skipped_steps", 0))
    from shardtune.metrics.trackers import make_trackers

    logger = MetricsLogger(ctx.rank, out, total_steps, progress=cfg.log.progress, jsonl=cfg.log.jsonl,
                           resume_step=sampler.position,
                           trackers=lambda: make_trackers(cfg.log, out, cfg.model_dump(mode="json", by_alias=True)))
    peak = peak_flops(torch.cuda.get_device_name(ctx.device)) if ctx.device.type == "cuda" else None
    run = Run(cfg, ctx, out, hf_config, tokenizer, data, sampler, built, backend, schedule, ckpt, logger,
              total_steps=total_steps, stop=min(total_steps, t.stop_after_step or total_steps),
              predicted=write_prediction(cfg, hf_config, ctx, out), resume=resume,
              state=RunState(step=sampler.position, skipped=skipped if resume else 0),
              flops_per_token=_flops_per_token(built, hf_config, t.seq_len),
              peak_flops=peak)
    run.cudagraphs = uses_cudagraphs(cfg.parallel)
    if cfg.log.profile is not None:
        run.profiler = StepProfiler(cfg.log.profile.start, cfg.log.profile.steps, out, ctx.rank, ctx.device)
    if cfg.log.memory_snapshot is not None:
        run.memory = MemorySnapshot(*cfg.log.memory_snapshot, out, ctx.rank, ctx.device)
    if cfg.log.system and ctx.is_main:
        run.system = SystemSampler().start()
    _print_start(run)
    return run


def _load_kept(built: BuiltModel, weights: Any, ctx: DistContext) -> None:
    before = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    count = load_kept(built, weights, ctx.device)
    added = (torch.cuda.memory_allocated(ctx.device) - before) / 2**30 if ctx.device.type == "cuda" else 0.0
    log_rank0(ctx.rank, f"float8 base: {count} frozen layers kept as their float8 casts"
              + (f" ({added:.1f} GiB)" if added > 0 else ""))


def _liger_loss(cfg: Config, ctx: DistContext, built: BuiltModel, backend: Backend, kernels: bool) -> None:
    """model.liger (its kernels went in with the model: assemble): Liger's fused linear + cross-entropy as the loss,
    computed in the model's forward on every backend, unless LoRA adapts the LM head; and the line that says what
    applies."""
    from shardtune.models.liger import install_fused_loss, liger_loss
    from shardtune.models.liger_rules import chunk_tokens

    adapted_head = head_adapted(cfg.peft.method, cfg.peft.target_modules)
    fused = not adapted_head
    if fused:
        install_fused_loss(built.base, liger_loss(chunk_tokens(cfg.model.liger_chunk), cfg.model.liger_accum))
        backend.fused_loss = True
    head_in_fp32 = fused and cfg.model.liger_accum == "fp32" and cfg.peft.method == "none"
    parts = (["RMSNorm, RoPE, SwiGLU kernels"] if kernels else []) + (
        ["fused linear + cross-entropy loss" + (" (the head's gradient summed in fp32)" if head_in_fp32 else "")]
        if fused else
        ["the loss stays plain (LoRA on lm_head)"])
    log_rank0(ctx.rank, "liger: " + ", ".join(parts))


def resume_point(cfg: Config, root: Path, ctx: DistContext) -> Path | None:
    """The checkpoint to resume from, its files checked against the manifest's checksums once per run: by the
    launcher (`shardtune train`, which hands the workers its path), else here by rank 0, whose answer (or
    refusal) every rank takes."""
    value = cfg.checkpoint.resume
    if not value:
        return None
    if os.environ.get(VERIFIED_ENV) == value:
        return resolve_checkpoint(value, root)  # sizes only: the launcher read every byte
    if ctx.world == 1 or not torch.distributed.is_initialized():
        return resolve_checkpoint(value, root, check=True)
    answer: list[Any] = [None]
    if ctx.is_main:
        try:
            answer = [str(resolve_checkpoint(value, root, check=True) or "")]
        except ShardtuneError as err:
            answer = [err]
    torch.distributed.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], ShardtuneError):
        raise answer[0]
    return Path(answer[0]) if answer[0] else None


def resolve_plan_auto(cfg: Config, hf_config: Any, ctx: DistContext) -> Config:
    """Workers started by torchrun directly (not through `shardtune train`, which resolves it first) plan
    `auto` strategy / micro-batch themselves: the same pure function on every rank gives the same answer."""
    from shardtune.plan import auto_keys

    if not auto_keys(cfg):
        return cfg
    from shardtune.plan import resolve_auto
    from shardtune.plan.hardware import detect

    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world))
    resolved, plan = resolve_auto(cfg, hf_config, detect(), world=ctx.world, per_node=local, force=True)
    log_rank0(ctx.rank, f"planner: {plan.reason()}")
    return resolved


def write_prediction(cfg: Config, hf_config: Any, ctx: DistContext, out: Path) -> dict[str, Any] | None:
    """OUTPUT_DIR/plan.json: the planner's prediction for this run, so every run is a calibration point
    (`shardtune plan --check OUTPUT_DIR`). On a CPU the 'device' is the host's share per process."""
    from shardtune.plan import cpu_hardware, run_record
    from shardtune.plan.hardware import detect

    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world))
    try:
        hw = detect() if ctx.device.type == "cuda" else None
        record = run_record(cfg, hf_config, hw or cpu_hardware(local), world=ctx.world, per_node=local)
    except Exception as err:  # a model the planner cannot read must not stop training
        log_rank0(ctx.rank, f"planner: no prediction for this run ({type(err).__name__}: {err})")
        return None
    if ctx.is_main:
        (out / "plan.json").write_text(json.dumps(record, indent=2))
    return record


def _flops_per_token(built: BuiltModel, hf_config: Any, seq_len: int) -> float:
    """With adapters, the frozen base does forward and input-gradient matmuls but no weight gradients."""
    frozen = built.params - built.trainable if built.adapters else built.params
    return flops_per_token(matmul_params(frozen, hf_config), hf_config.num_hidden_layers, hf_config.hidden_size,
                           seq_len, trainable=built.trainable if built.adapters else None)


def _print_start(run: Run) -> None:
    cfg, built, log = run.cfg, run.built, run.logger
    if built.adapters:
        log.print(f"{cfg.peft.method}: {built.trainable / 1e6:,.2f}M trainable parameters "
                  f"({built.trainable / built.params:.2%}), r={cfg.peft.r}, alpha={cfg.peft.alpha:g}")
    log.print(f"shardtune: {run.hf_config.model_type} {built.params / 1e6:,.1f}M params, {cfg.parallel.strategy} on "
              f"{run.ctx.world} x {run.ctx.device.type}, {run.total_steps} steps of {run.sampler.global_batch} "
              "sequences")
    log.print(data_line(run.data))
    if host := getattr(run.backend, "frozen_on_host", lambda: "")():  # the direct path's peft.offload_*
        log.print(host)
    if skipped := skipped_line(run.data.reports):  # as validate reports them: a skip is never silent
        log.print(skipped)
    t, world = cfg.train, run.ctx.world
    cap = eval_batch_cap(t, run.total_steps)
    if len(run.data.eval) and cap < eval_num_batches(len(run.data.eval), t.micro_batch_size, world):
        log.print(f"eval: the first {cap * t.micro_batch_size * world:,} of {len(run.data.eval):,} held-out examples "
                  f"each time (train.eval_batches={t.eval_batches}: {cap} micro-batches per process; all = every one)")
    if run.resume:
        log.print(f"resumed from {run.resume} at step {run.state.step}")
    if run.system is not None and run.system.nvml_error and run.ctx.device.type == "cuda":
        log.print(f"log.system: {run.system.nvml_error}; logging the process's memory (rss_gib) instead of GPU "
                  "samples")


@dataclass
class _Pending:
    """A step whose outcome the loop has not read yet. The direct path's fused update decides a non-finite skip
    on the GPU and leaves its flag in pinned memory (backend.skip_flag); reading it at once would make the host
    wait at every step's end for the GPU to finish the backward, and the next step's kernels would start only as
    fast as the host launches them (8B LoRA on one H200 left the GPU idle ~11% of a step, bench/RESULTS.md,
    nineteenth session). So the loop reads it once the next step's forward and backward are queued, or at once
    where a log, checkpoint, evaluation or stop needs it."""

    step: int
    step_loss: torch.Tensor
    tokens: int
    flag: HostCopy | None  # None: `skipped` is already known
    skipped: bool
    loss_read: HostCopy | None  # rank 0's loss for the spike warning
    lr: float
    grad_norm: torch.Tensor


def _train_step(run: Run, step: int, interval: _Interval) -> None:
    """One optimizer step (all its micro-batches), then the checkpoint and the log record it is due."""
    backend, ctx, state = run.backend, run.ctx, run.state
    counter = comm.current()
    if counter is not None:
        counter.take()  # what ran since the last step (eval, checkpoint saves) is not this step's traffic
    if run.profiler is not None:
        run.profiler.before(step + 1)
    if run.memory is not None:
        run.memory.before(step + 1)
    started = time.perf_counter()
    micro = [run.data.train_batch(idx) for idx in run.sampler.micro_batches(step)]
    interval.data_s += time.perf_counter() - started
    _TEST_NAN[0] = float("nan") if step + 1 in _test_nan_steps() else 1.0
    if os.environ.get(TEST_SIGKILL_ENV) == f"{ctx.rank}:{step + 1}":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(TEST_OOM_ENV) == str(step + 1):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({TEST_OOM_ENV})")
    normalizer = global_target_tokens(micro, ctx.device)
    lr = current_lr(backend.optimizer)
    step_loss = torch.zeros((), device=ctx.device)
    for k, batch in enumerate(micro):
        if run.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        step_loss += backend.forward_backward(to_device(batch, ctx.device), normalizer,
                                              sync_grads=k == len(micro) - 1)
    _TEST_NAN[0] = 1.0
    before = run.pending
    if before is not None and _settle(run, interval):
        # The step before was the max_bad_steps-th non-finite one in a row: the run stops there, as if this step
        # had not begun (its gradients dropped; the sampler and the LR schedule stay at the step before).
        backend.optimizer.zero_grad(set_to_none=True)
        _end_step(run, interval, counter, before.lr, before.grad_norm, stop_bad=True)
        return
    interval.checkpoint_s += run.ckpt.before_update()  # an async save's copy must finish before the update
    # rank 0's loss for the spike warning, copied before the update is queued: reading it after does not wait
    # for the update (a plain read would, and the GPU would idle while the host prepares the next step)
    loss_read = HostCopy(step_loss) if run.cfg.train.loss_spike_factor and ctx.is_main else None
    grad_norm = backend.step()
    if backend.step_applied:
        run.schedule.step()  # also after a skipped update: the LR is a function of the step number
    run.pending = _Pending(step + 1, step_loss, sum(b.num_tokens for b in micro), getattr(backend, "skip_flag", None),
                           bool(getattr(backend, "step_skipped", False)), loss_read, lr, grad_norm)
    state.step = run.sampler.position = step + 1
    _end_step(run, interval, counter, lr, grad_norm)


def _settle(run: Run, interval: _Interval) -> bool:
    """Read the pending step's outcome into the interval and the run's counts; True when it was the
    max_bad_steps-th non-finite step in a row (the run stops there, with a checkpoint)."""
    p, run.pending = run.pending, None
    assert p is not None
    skipped = p.skipped if p.flag is None else p.flag.values()[0] > 0
    interval.add(p.step_loss, p.tokens, skipped)
    stop_bad = _count_bad_step(run, skipped, p.step)
    if not skipped and p.loss_read is not None:
        _watch_spikes(run, p.loss_read.values()[0], p.step)
    return stop_bad


def _end_step(run: Run, interval: _Interval, counter: Any, lr: float, grad_norm: torch.Tensor, *,
              stop_bad: bool = False) -> None:
    """After step state.step's update is queued: the stop / save requests, and the checkpoint and log record
    it is due (each reads the pending outcome first)."""
    ctx, state = run.ctx, run.state
    request = signals.agree(ctx.device)  # every rank stops (or saves) after the same step
    if counter is not None:
        step_comm = counter.take()
        comm.merge(interval.comm, step_comm)
        comm.merge(state.comm, step_comm)
        state.comm_steps += 1
        if run.profiler is not None:
            run.profiler.add_comm(state.step, step_comm)
    if request.stop:
        state.stopped_by, run.stop = request.stop, state.step
    due = run.ckpt.due(state.step, last=state.step == run.stop)
    log_due = state.step % run.cfg.log.every == 0 or state.step == run.stop
    eval_due = bool(run.cfg.train.eval_every) and state.step % run.cfg.train.eval_every == 0
    if run.pending is not None and (run.pending.flag is None or request.stop or request.save or due or log_due
                                    or eval_due):
        stop_bad = _settle(run, interval) or stop_bad
    asked = (request.stop or request.save) and state.step != run.ckpt.last_saved_step
    if asked or stop_bad or due:
        check_finite_weights(run, "checkpoint")
        interval.checkpoint_s += run.ckpt.save(state.step, run.backend, trainer_state(run))
        if asked and not request.stop:
            run.logger.print(f"saved a checkpoint at step {state.step} (SIGUSR1)")
    if log_due or stop_bad:
        record = interval.flush(state.step, lr, grad_norm, run.flops_per_token, run.peak_flops, ctx)
        record["epoch"] = (state.step - 1) // run.sampler.steps_per_epoch
        record["skipped_steps"] = state.skipped
        record.update(run.ckpt.pop_timings())
        state.history.append(record)
        run.logger.log(record)
    if run.profiler is not None or run.memory is not None:
        # Writing a profiler trace or a memory snapshot takes seconds; the next logged interval leaves it out
        # of its tokens/s as it does a checkpoint save (a 1B run on one H200 logged 17,595 tokens/s for it).
        started = time.perf_counter()
        if run.profiler is not None:
            run.profiler.after(state.step)
            interval.extra.update(run.profiler.take_fields())  # the profiled steps' bus bandwidth, logged once
        if run.memory is not None:
            run.memory.after(state.step)
        interval.trace_s += time.perf_counter() - started


def _count_bad_step(run: Run, skipped: bool, step: int) -> bool:
    """Count a skipped step and say so; True when max_bad_steps in a row are reached (stop, with a checkpoint)."""
    state = run.state
    if not skipped:
        state.bad_in_row = 0
        return False
    state.skipped += 1
    state.bad_in_row += 1
    limit = run.cfg.train.max_bad_steps
    log_rank0(run.ctx.rank, f"step {step}: non-finite loss or gradient norm; update skipped (gradients zeroed; "
                            f"{state.bad_in_row} in a row, the run stops at {limit})")
    return state.bad_in_row >= limit


def _watch_spikes(run: Run, loss: float, step: int) -> None:
    """Warn once per spike: rank 0's step loss above loss_spike_factor x the median of its last 50."""
    factor, state = run.cfg.train.loss_spike_factor, run.state
    if len(state.recent) >= 10:
        median = statistics.median(state.recent)
        spike = loss > factor * median
        if spike and not state.in_spike:
            log_rank0(run.ctx.rank, f"warning: step {step}: loss spike, {loss:.4g} is over {factor:g}x the "
                                    f"median of the last {len(state.recent)} steps ({median:.4g})")
        state.in_spike = spike
    state.recent.append(loss)


def check_finite_weights(run: Run, what: str) -> None:
    """Refuse to write a `what` (checkpoint, model) whose trainable weights hold NaN or Inf: one pass over each
    rank's shards and one all-reduce, at save time only. Frozen weights are not updated, so not checked."""
    bad = torch.zeros((), device=run.ctx.device)
    for p in run.backend.module.parameters():
        if p.requires_grad and p.is_floating_point():
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += (~torch.isfinite(local.detach())).any()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(bad)
    if bad.item():
        raise ShardtuneError(f"step {run.state.step}: the weights hold NaN or Inf values; no {what} was written "
                             "(the last checkpoint holds finite ones); keep train.skip_nonfinite true, lower "
                             "train.lr, and --resume auto")


_TEST_NAN = [1.0]  # the factor the loss is multiplied by this step (NaN only where SHARDTUNE_TEST_NAN_STEPS says)


def _test_nan_steps() -> set[int]:
    value = os.environ.get(TEST_NAN_ENV, "")
    return {int(x) for x in value.split(",") if x.strip()}


def _with_test_nan(loss_fn: Any) -> Any:
    """The loss, poisoned with NaN at the steps SHARDTUNE_TEST_NAN_STEPS names (tests only; unset, unchanged)."""
    if not os.environ.get(TEST_NAN_ENV):
        return loss_fn

    def poisoned(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, labels) * _TEST_NAN[0]

    return poisoned


def finish(run: Run, finished: bool, train_seconds: float, *, overwrite: bool = False) -> TrainResult:
    """After the last step: the final model (or adapter; `overwrite`: train --overwrite), summary.json and the
    closing line."""
    cfg, ctx, out = run.cfg, run.ctx, run.out
    run.logger.close()
    if run.system is not None:
        run.system.close()
    if cfg.checkpoint.save_final and finished:
        check_finite_weights(run, "model" if not run.built.adapters else "adapter")
    if cfg.checkpoint.save_final and finished and run.built.adapters:
        from shardtune.peft.lora import adapter_base

        base, readme = adapter_base(cfg.model)
        save_adapter(run.backend.module, out / "adapter", base, run.tokenizer, ctx.rank, gather=run.backend.full_tensor,
                     source=f"training run {out}", overwrite=overwrite, readme=readme)
    elif cfg.checkpoint.save_final and finished:
        save_hf_model(run.backend.module, run.hf_config, run.tokenizer, out / "model",
                      dtype=SAVE_DTYPES[save_dtype(cfg)], max_shard_bytes=parse_size(cfg.checkpoint.max_shard_size),
                      rank=ctx.rank, gather=run.backend.full_tensor, source=f"training run {out}",
                      overwrite=overwrite)
    summary = _summary(run, train_seconds)
    summary["throughput"] = throughput(run.state.history)
    if run.predicted is not None:
        from shardtune.plan import compare

        summary["plan"] = compare(run.predicted, run.state.history)
    summary["comm"] = comm_summary(run)
    if ctx.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        write_run_report(run)
        run.logger.print(_done_line(run, train_seconds))
        if summary["throughput"]:
            run.logger.print(throughput_line(summary["throughput"], run.ctx.device.type))
    return TrainResult(summary, run.backend)


def throughput(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's speed in one place: medians over the logged intervals after the first (compile and warm-up
    fall in it; all of them when only one was logged), peak memory over all. Evaluation and checkpoint time
    are already out of every record."""
    if not history:
        return None
    steady = history[1:] or history
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
            "tokens_per_sec_per_device": statistics.median(r["tokens_per_sec_per_device"] for r in steady),
            "tokens_per_sec_min": min(r["tokens_per_sec"] for r in steady),
            "tokens_per_sec_max": max(r["tokens_per_sec"] for r in steady),
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in history),
            "peak_reserved_gib": max(r["peak_reserved_gib"] for r in history),
            "steady_peak_mem_gib": max(r["peak_mem_gib"] for r in steady),  # without the first interval's compile
            "step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "intervals": len(steady), "from_step": steady[0]["step"]}


def throughput_line(t: dict[str, Any], device_type: str) -> str:
    """The last line of a run: the numbers a user compares runs by."""
    mfu = f", MFU {t['mfu']:.1%}" if t["mfu"] is not None else ""
    steady = t.get("steady_peak_mem_gib", t["peak_mem_gib"])
    after = f" ({steady:.1f} from step {t['from_step']})" if device_type == "cuda" and \
        t["peak_mem_gib"] - steady >= 0.05 else ""  # the first interval's compile held more
    memory = (f"peak memory {t['peak_mem_gib']:.1f} GiB allocated{after}, {t['peak_reserved_gib']:.1f} GiB reserved"
              if device_type == "cuda" else f"peak memory {t['peak_mem_gib']:.1f} GiB (host RSS)")
    return (f"throughput: {t['tokens_per_sec']:,.0f} tokens/s ({t['tokens_per_sec_per_device']:,.0f} per device, "
            f"{t['tokens_per_sec_min']:,.0f}-{t['tokens_per_sec_max']:,.0f}){mfu}, {memory}; median of "
            f"{t['intervals']} logged intervals from step {t['from_step']}, without evaluation and checkpoint time")
def write_run_report(run: Run) -> None:
    """OUTPUT_DIR/report (log.report): plots of what the run logged. A run that trained is never failed by its
    report: without matplotlib, or on any error drawing it, one line says so and training's result stands."""
    if not (run.cfg.log.report and run.cfg.log.jsonl):
        return
    from shardtune.report import REPORT_DIR, write_report

    try:
        write_report([run.out], run.out / REPORT_DIR)
    except Exception as err:  # the run's own files are written; a plot must not turn success into failure
        run.logger.print(f"report: not written ({err}); `shardtune report {run.out}` draws it later")


def comm_summary(run: Run) -> dict[str, Any]:
    """summary.json's `comm`: rank 0's bus bytes and calls per training step by collective (evals and checkpoint
    saves excluded), with the planner's prediction of the same bytes."""
    n = max(run.state.comm_steps, 1)
    predicted = (run.predicted or {}).get("chosen", {}).get("comm_bytes_per_step")
    return {"steps": run.state.comm_steps,
            "bus_bytes_per_step": {k: t["bus_bytes"] / n for k, t in sorted(run.state.comm.items())},
            "bytes_per_step": {k: t["bytes"] / n for k, t in sorted(run.state.comm.items())},
            "calls_per_step": {k: t["calls"] / n for k, t in sorted(run.state.comm.items())},
            "predicted_bus_bytes_per_step": predicted,
            # log.profile on a GPU: NCCL kernel time and achieved bus bandwidth of the profiled steps
            "profiled": run.profiler.collectives if run.profiler is not None else None}


def write_hf_dir(path: Path, built: BuiltModel, hf_config: Any, tokenizer: Any, dtype: torch.dtype) -> None:
    """A checkpoint's hf/ folder: the base model's config and tokenizer (+ the adapter config for LoRA)."""
    write_config(built.base, hf_config, tokenizer, path, dtype)
    if built.adapters:
        built.model.peft_config["default"].save_pretrained(str(path))


def save_dtype(cfg: Config) -> str:
    name = cfg.checkpoint.save_dtype
    return ("fp32" if cfg.train.precision == "fp32" else "bf16") if name == "auto" else name


def _done_line(run: Run, seconds: float) -> str:
    step, total = run.state.step, run.total_steps
    if run.state.stopped_by:
        return (f"stopped by {signals.signal_name(run.state.stopped_by)} after step {step} of {total} "
                f"({seconds:.1f}s), checkpoint {run.ckpt.root / f'step-{step:08d}'}; continue with the same "
                "command and --resume auto")
    if step < total:
        return f"stopped after step {step} of {total} ({seconds:.1f}s); continue with --resume auto"
    kind = "adapter" if run.built.adapters else "model"
    parts = [f"done: {total} steps in {seconds:.1f}s"]
    last = next((r for r in reversed(run.state.history) if r.get("loss") is not None), None)
    scores = [f"train loss {last['loss']:.4f}"] if last else []
    if run.state.evals:
        final = run.state.evals[-1]
        scores.append(f"eval loss {final['eval_loss']:.4f}")
        if final.get("eval_accuracy") is not None:
            scores.append(f"exact match {final['eval_accuracy']:.1%}")
    if scores:
        parts.append(", ".join(scores))
    if run.cfg.checkpoint.save_final:
        parts.append(f"{kind} in {run.out / kind}")
    checkpoints = complete_checkpoints(run.ckpt.root)
    if checkpoints:
        parts.append(f"checkpoints in {run.ckpt.root} (newest {checkpoints[-1].name})")
    return "; ".join(parts)


def trainer_state(run: Run) -> dict[str, Any]:
    """The JSON part of a checkpoint: where the run is and how it was set up."""
    cfg, sampler = run.cfg, run.sampler
    if not run.saved_config:  # masked once: the config does not change while the run goes on
        run.saved_config = redact(cfg.model_dump(mode="json", by_alias=True))
    extra = {"scheduler": jsonable(run.schedule.state_dict()), **run.backend.extra_state()}
    return {"step": run.state.step, "total_steps": run.total_steps, "sampler": sampler.state_dict(),
            "extra": extra, "world_size": run.ctx.world, "global_batch": sampler.global_batch,
            "micro_batch_size": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum,
            "strategy": cfg.parallel.strategy, "skipped_steps": run.state.skipped,
            "config": run.saved_config}  # informational: nothing reads it back


def keep_global_batch(cfg: Config, saved: dict[str, Any], ctx: DistContext) -> Config:
    """Resuming on another number of processes: change grad_accum so each step sees the same
    global batch (and so the same examples) as before; refuse when that cannot be done."""
    t = cfg.train
    target = int(saved["global_batch"])
    per_step = t.micro_batch_size * ctx.world
    if per_step * t.grad_accum == target:
        return cfg
    if target % per_step:
        raise ShardtuneError(f"the checkpoint trained on {target} sequences per step, which {ctx.world} processes x "
                             f"train.micro_batch_size={t.micro_batch_size} cannot divide; choose micro_batch_size "
                             f"and grad_accum with micro_batch_size * grad_accum * processes = {target}")
    new = cfg.model_copy(deep=True)
    new.train.grad_accum = target // per_step
    log_rank0(ctx.rank, f"resuming on {ctx.world} processes: train.grad_accum {t.grad_accum} -> "
                        f"{new.train.grad_accum} keeps the checkpoint's {target} sequences per step")
    return new


def global_target_tokens(micro: list[Batch], device: torch.device) -> torch.Tensor:
    """Loss-carrying tokens of this step over all micro-batches and ranks, kept on the device
    (no host sync: the next step's kernels queue up behind the all-reduce)."""
    # torch.full, not torch.tensor: torch.tensor(x, device=cuda) is a blocking copy, which waits for every kernel
    # queued before it (pytorch/pytorch#190217)
    count = torch.full((), float(sum(b.num_target_tokens for b in micro)), device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(count)
    return count


def _timed(fn: Any, *args: Any, device: torch.device) -> float:
    """Seconds `fn(*args)` took. On a GPU the queued training kernels finish first, so their time stays
    the interval's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


class _Interval:
    """Loss and token counts between two logged steps; one collective per log, not per step. Its tokens/s,
    MFU and step time count training time only: the evaluation, checkpoint and trace-writing time inside the
    interval is taken out (and logged as eval_s / checkpoint_s / trace_s), so a step that ran an evaluation is
    not reported slow. Where a step's time went, for a step slower than its neighbours: `host_s` (per step, the
    host's time before the record's read waited on the device: well below `step_time_s`, the host had time to
    spare; near it, either the host set the pace or its launches waited for the GPU's full launch queue, as in
    every 8B LoRA step measured, GPU-bound or not: then the sampler's clock and busy % tell which; on several
    processes each step's agreement on stop / save requests waits for the GPU, so there it is always near),
    `data_s` (per step, building the micro-batches), `gc_s` (per step, garbage collection; both the slowest
    rank's) and, on CUDA, `alloc_retries` (the caching allocator freed its cache and retried a cudaMalloc: a
    synchronising stall near full memory; summed over ranks, with `alloc_retries_ranks` on several: one rank's
    stall holds up every collective)."""

    def __init__(self, device: torch.device, sampler: SystemSampler | None = None) -> None:
        self.device = device
        self.sampler = sampler
        self.gc: GcClock | None = None  # the loop's collections (collect_between_steps)
        self.data_s = 0.0
        self.retries = _alloc_retries(device)
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.skipped = 0
        self.tokens = 0
        self.checkpoint_s = 0.0  # time the loop was blocked by checkpoint saves in this interval
        self.eval_s = 0.0  # time spent evaluating in this interval
        self.trace_s = 0.0  # time writing log.profile traces and log.memory_snapshot files in this interval
        self.comm: dict[str, dict[str, float]] = {}  # this rank's collectives in the interval, by kind
        self.extra: dict[str, float] = {}  # fields for the next record only (the profiled steps' bandwidth)
        self.t0 = time.perf_counter()

    def add(self, step_loss: torch.Tensor, tokens: int, skipped: bool = False) -> None:
        if skipped:  # its loss is not finite: the average is over the steps that updated
            self.skipped += 1
        else:
            self.loss_sum += step_loss
        self.steps += 1
        self.tokens += tokens

    def flush(self, step: int, lr: float, grad_norm: torch.Tensor, fpt: float, peak: float | None,
              ctx: DistContext) -> dict[str, Any]:
        host = time.perf_counter() - self.t0 - self.checkpoint_s - self.eval_s - self.trace_s
        loss_sum, tokens = all_reduce_sum([float(self.loss_sum), float(self.tokens)], self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - self.t0 - self.checkpoint_s - self.eval_s - self.trace_s, 1e-9)
        retries = _alloc_retries(self.device)
        gc_s = self.gc.take() if self.gc is not None else 0.0
        # [allocated, reserved, allocator retries, batch-building s, collection s] per rank, in one collective
        ranks = all_gather_floats([*_peak_memory_gib(self.device), float(max(retries - self.retries, 0)),
                                   self.data_s, gc_s], self.device)
        self.retries = retries
        mem = [max(r[0] for r in ranks), max(r[1] for r in ranks)]
        tps = tokens / seconds
        record = {
            "step": step, "loss": loss_sum / (self.steps - self.skipped) if self.steps > self.skipped else math.nan,
            "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / ctx.world,
            "mfu": mfu(tps / ctx.world, fpt, peak), "peak_mem_gib": mem[0], "peak_reserved_gib": mem[1],
            "step_time_s": seconds / self.steps, "host_s": max(host, 0.0) / self.steps,
            # the slowest rank's: every rank waits for it at the step's first collective
            "data_s": max(r[3] for r in ranks) / self.steps, "gc_s": max(r[4] for r in ranks) / self.steps,
            "peak_mem_gib_ranks": [r[0] for r in ranks], "peak_reserved_gib_ranks": [r[1] for r in ranks],
        }
        if self.sampler is not None:
            record.update(self.sampler.take())
        record.update(_retries_fields([int(r[2]) for r in ranks]))
        if self.checkpoint_s:
            record["checkpoint_s"] = self.checkpoint_s
        if self.eval_s:
            record["eval_s"] = self.eval_s
        if self.trace_s > 0.01:  # the profiler's and snapshot's hooks take microseconds on the other steps
            record["trace_s"] = self.trace_s
        record.update(comm.per_step(self.comm, self.steps))
        record.update(self.extra)
        self.comm, self.extra = {}, {}
        self.loss_sum.zero_()
        self.steps, self.skipped, self.tokens, self.data_s = 0, 0, 0, 0.0
        self.checkpoint_s, self.eval_s, self.trace_s, self.t0 = 0.0, 0.0, 0.0, time.perf_counter()
        return record


def _retries_fields(per_rank: list[int]) -> dict[str, Any]:
    """The allocator-retry fields of a record: none where no rank retried; the sum, and each rank's count where
    there are several (the rank that stalled is the one near its memory limit)."""
    if not any(per_rank):
        return {}
    return {"alloc_retries": sum(per_rank), **({"alloc_retries_ranks": per_rank} if len(per_rank) > 1 else {})}


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def _peak_memory_gib(device: torch.device) -> list[float]:
    """[allocated, reserved] peak on a GPU since the last logged interval (the counters start again here, as
    torchtitan's memory monitor does after each log: the first interval holds compile's transients, the later ones
    a step's own; the run's peak is the max over intervals); on a CPU both are the process's peak resident set
    size, which cannot start again."""
    if device.type == "cuda":
        peak = [torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30]
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return [rss, rss]


def data_line(data: DataBundle) -> str:
    s = data.stats
    rows = (f"packed into {s['packed_rows']:,} rows ({s['packing_efficiency']:.0%} of tokens real)" if data.packed
            else f"padded to {data.seq_len} ({s['padded_efficiency']:.0%} of tokens real)")
    return f"data: {s['train_examples']:,} train examples {rows}, {s['eval_examples']:,} eval examples"


def eval_batch_cap(t: TrainConfig, total_steps: int | None) -> int:
    """Eval micro-batches per process each evaluation may run (train.eval_batches). `auto` sizes it to the run:
    half the training micro-batches between two evaluations (eval_every, else the whole run; a run shorter than
    eval_every evaluates at its start and its end only). A forward costs about a third of a training micro-batch,
    so evaluating takes at most about a sixth of the training time; a 30-step run on 1,000 held-out examples no
    longer spends most of its time evaluating, nor a 4-step try of a config that evaluates every 100."""
    if t.eval_batches in ("all", None):
        return 2**62
    if t.eval_batches != "auto":
        return int(t.eval_batches)
    if total_steps is None:
        return 2**62
    between = min(t.eval_every or total_steps, total_steps)
    return max(1, -(-between * t.grad_accum // 2))


def _evaluator(backend: Backend, data: DataBundle, cfg: Config, ctx: DistContext, logger: MetricsLogger,
               state: RunState, total_steps: int):
    def run(step: int) -> None:
        if not len(data.eval):
            return
        metrics = evaluate(backend, data, cfg, ctx, total_steps)
        record = {"step": step, **metrics}
        state.evals.append(record)
        logger.log({"eval": True, **record})
        logger.eval_line(step, metrics)

    return run


@torch.no_grad()
def evaluate(backend: Backend, data: DataBundle, cfg: Config, ctx: DistContext,
             total_steps: int | None = None) -> dict[str, float]:
    """Mean token loss and exact-match accuracy over the held-out set (its first eval_batch_cap micro-batches
    per process), summed over ranks."""
    t = cfg.train
    lists = eval_batches(len(data.eval), t.micro_batch_size, ctx.world, ctx.rank)
    n = min(eval_num_batches(len(data.eval), t.micro_batch_size, ctx.world), eval_batch_cap(t, total_steps))
    backend.train(False)
    cudagraphs = uses_cudagraphs(cfg.parallel)
    loss_sum, tokens, right, rows = 0.0, 0, 0, 0
    for i in range(n):
        # Same shape on every rank and step (no recompiles); a rank whose share ran out still joins
        # the forward pass with all-padding rows that carry no loss.
        batch = to_device(data.eval_batch(lists[i], t.micro_batch_size), ctx.device)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = backend.forward(batch)  # every rank runs the same number of forwards (FSDP collectives)
        loss_sum += float(token_loss_sum(logits, batch.labels))
        tokens += batch.num_target_tokens
        r, k = exact_match(logits, batch.labels)
        right, rows = right + r, rows + k
    backend.train(True)
    loss_sum, tokens, right, rows = all_reduce_sum([loss_sum, tokens, right, rows], ctx.device)
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_accuracy": right / max(rows, 1)}


def _summary(run: Run, seconds: float) -> dict[str, Any]:
    cfg, state, out = run.cfg, run.state, run.out
    last = state.history[-1] if state.history else {}
    final = cfg.checkpoint.save_final
    return {
        "steps": run.total_steps, "world_size": run.ctx.world, "strategy": cfg.parallel.strategy,
        "precision": cfg.train.precision, "params": run.built.params, "train_seconds": seconds,
        "final_loss": last.get("loss"), "losses": [r["loss"] for r in state.history],
        "grad_norms": [r["grad_norm"] for r in state.history],  # before clipping
        "evals": state.evals, "output_dir": str(out),
        "stopped_by": signals.signal_name(state.stopped_by) if state.stopped_by else None,
        "exit_code": 128 + state.stopped_by if state.stopped_by else 0,
        "model_dir": str(out / "model") if final and not run.built.adapters else None,
        "adapter_dir": str(out / "adapter") if final and run.built.adapters else None,
    }
