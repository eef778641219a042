"""`shardtune validate`: every check that needs no GPU and no process group, before a run starts."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Any

from shardtune.config import Config, load_config
from shardtune.errors import ShardtuneError


def validate(path: str, overrides: list[str], *, nproc_flag: int | str | None = None, quiet: bool = False,
             nnodes: int = 1, hardware: Any = None, force: bool = False, overwrite: bool = False) -> Config:
    """Check config, model, tokenizer and data (tokenised into the cache, so the workers that follow
    find it there), that one global batch fits the data, and that the run's final model/adapter folder
    may be written (`overwrite`: train --overwrite). With quiet=False print a report.
    With `hardware` (the local GPU, or one named with --gpu) the planner refuses a run predicted not to fit
    (unless `force`); `auto` strategy / micro-batch are replaced by its pick. Returns the resolved config.
    Raises ShardtuneError (exit code 2) on the first problem."""
    from shardtune.launch import resolve_nproc
    from shardtune.models.build import load_hf_config
    from shardtune.models.tokenizer import load_tokenizer
    from shardtune.train.loop import check_vocab

    cfg = load_config(path, overrides)
    hf_config = load_hf_config(cfg.model)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos and cfg.train.seq_len > max_pos:
        raise ShardtuneError(f"train.seq_len: {cfg.train.seq_len} exceeds the model's max_position_embeddings "
                             f"({max_pos}); set train.seq_len <= {max_pos}")
    paths = [("data.train_file", cfg.data.train_file), ("data.eval_file", cfg.data.eval_file),
             *((f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources))]
    for key, path in paths:
        if path is not None and not Path(path).exists():
            raise ShardtuneError(f"{key}: {path!r} does not exist; give a data file or folder")
    world = resolve_nproc(nproc_flag, cfg.parallel.nproc)
    if nnodes < 1:
        raise ShardtuneError(f"--nnodes {nnodes}: expected a positive integer")
    plan = None
    if hardware is not None or cfg.parallel.strategy == "auto" or cfg.train.micro_batch_size == "auto":
        from shardtune.plan import resolve_auto

        cfg, plan = resolve_auto(cfg, hf_config, hardware, world=world * nnodes, per_node=world, force=force)
    check_combination(cfg, world)
    check_final_dir(cfg, overwrite)
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    check_vocab(tokenizer, hf_config)
    if cfg.checkpoint.resume not in (None, "auto"):
        from shardtune.checkpoint.dcp import resolve_checkpoint

        resolve_checkpoint(cfg.checkpoint.resume)  # a named checkpoint must exist and be complete
    if quiet and plan is not None:
        from shardtune.plan import describe

        c = plan.chosen()
        auto = f" ({', '.join(plan.auto)}: auto)" if plan.auto else ""
        print(f"plan: {describe(c.setting)}{auto}: {c.memory.total / 2**30:.1f} GiB per GPU of "
              f"{plan.hardware.memory_bytes / 2**30:.1f} ({plan.hardware.name}), {c.time.tokens_per_sec_per_gpu:,.0f} "
              "tokens/s per GPU predicted", flush=True)
    if quiet:
        from shardtune.data import StepSampler
        from shardtune.data.pipeline import build_data

        t = cfg.train
        data = build_data(cfg.data, tokenizer, t.seq_len, t.seed, builder=True)
        StepSampler(len(data.train), t.micro_batch_size, t.grad_accum, world, 0, t.seed)
        return cfg
    _report(cfg, hf_config, tokenizer, world, plan)
    return cfg


def check_final_dir(cfg: Config, overwrite: bool = False) -> None:
    """The folder a finished run writes (OUTPUT_DIR/model, or adapter with LoRA) must be new, empty or an
    earlier one of shardtune's of the same kind, unless --overwrite: checked before training, not after it."""
    from shardtune.checkpoint.outdir import check_output_dir

    if not cfg.checkpoint.save_final:
        return
    kind = "adapter" if cfg.peft.method != "none" else "model"
    check_output_dir(Path(cfg.train.output_dir) / kind, kind, overwrite=overwrite,
                     fix="use another --output-dir, or add --overwrite to `shardtune train` to replace it and "
                         "everything in it")


def check_combination(cfg: Config, world: int | None = None) -> None:
    """Settings that cannot work together, refused before any process starts. With `world` (processes),
    also the DeepSpeed config the deepspeed backend would build (conflicts with the `deepspeed:` section)."""
    from shardtune.peft.optim8bit import adamw8bit_available
    from shardtune.peft.qlora import nf4_available

    _check_backend(cfg)
    if cfg.peft.method != "none" and (failed := peft_import_error()) is not None:
        raise ShardtuneError(f"peft.method: {cfg.peft.method} needs the peft package (import peft failed: {failed}); "
                             f"pip install -e '.[peft]' in the shardtune checkout (or pip install peft), or use "
                             f"peft.method=none")
    if cfg.peft.method == "qlora" and not nf4_available():
        raise ShardtuneError("peft.method: qlora needs torchao (NF4 weights that FSDP2 can shard); "
                             "pip install -e '.[qlora]' in the shardtune checkout")
    if cfg.peft.method == "qlora" and cfg.peft.use_dora:
        raise ShardtuneError("peft.use_dora: DoRA reads the dequantized base weight, which NF4 weights do not "
                             "offer here; use peft.method=lora with DoRA, or qlora without it")
    base, precision = cfg.peft.base_dtype, cfg.train.precision
    if cfg.peft.method != "none" and base not in ("auto", "fp32", precision):
        raise ShardtuneError(f"peft.base_dtype: {base} base weights with train.precision={precision} would meet "
                             f"{precision} activations in the matmuls; set peft.base_dtype=auto (or fp32), or "
                             f"train.precision={base}")
    if cfg.optim.name == "adamw8bit" and not adamw8bit_available():
        raise ShardtuneError("optim.name: adamw8bit needs torchao (its 8-bit AdamW keeps sharded states); "
                             "pip install -e '.[qlora]' in the shardtune checkout")
    if world is not None and cfg.parallel.strategy == "hsdp":
        from shardtune.parallel.fsdp2 import hsdp_shard_size

        hsdp_shard_size(cfg.parallel, world, world)  # `world` here: the processes per node
    if cfg.parallel.backend == "deepspeed":
        ds = None
        if world is not None:
            from shardtune.parallel.ds_config import deepspeed_config

            ds = deepspeed_config(cfg.parallel, cfg.train, cfg.optim, cfg.deepspeed, world)  # conflicts: ConfigError
        failed = deepspeed_import_error()
        if failed is not None:
            raise ShardtuneError(f"parallel.backend: deepspeed needs the deepspeed package (import deepspeed failed: "
                                 f"{failed}); pip install -e '.[deepspeed]' in the shardtune checkout, or use "
                                 "parallel.backend=fsdp2")
        if ds is not None:
            check_deepspeed_accepts(ds)


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


def _check_backend(cfg: Config) -> None:
    """Strategy, offload and feature combinations each backend can or cannot run (no imports, no GPU)."""
    p = cfg.parallel
    fsdp2 = p.backend == "fsdp2"
    if not fsdp2 and p.strategy == "hsdp":
        raise ShardtuneError("parallel.strategy: hsdp (FSDP2's hybrid sharding) needs parallel.backend=fsdp2; set it, "
                             "or use parallel.strategy=zero3 with deepspeed")
    if p.shard_size != "auto" and p.strategy != "hsdp":
        raise ShardtuneError(f"parallel.shard_size: set, but parallel.strategy is {p.strategy} (only hsdp shards "
                             "within groups); set parallel.strategy=hsdp, or remove shard_size")
    if fsdp2 and p.strategy == "zero1":
        raise ShardtuneError("parallel.strategy: zero1 (only optimizer states sharded) has no FSDP2 form; "
                             "set parallel.backend=deepspeed, or use parallel.strategy=zero2 with fsdp2")
    if fsdp2 and p.offload != "none":
        raise ShardtuneError(f"parallel.offload: {p.offload} offload is DeepSpeed ZeRO-Offload, which backend fsdp2 "
                             "does not have; set parallel.backend=deepspeed, or parallel.offload=none")
    if p.offload == "params" and p.strategy != "zero3":
        raise ShardtuneError(f"parallel.offload: params offloads parameters, which only zero3 partitions (strategy is "
                             f"{p.strategy}); set parallel.strategy=zero3, or parallel.offload=optimizer")
    if p.offload == "optimizer" and p.strategy == "ddp":
        raise ShardtuneError("parallel.offload: optimizer offload moves sharded optimizer states, and ddp shards "
                             "none; set parallel.strategy=zero1, zero2 or zero3, or parallel.offload=none")
    if p.offload_nvme_path is not None:
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
        if p.backend == "deepspeed" and not _async_io_available():
            raise ShardtuneError("parallel.offload_nvme_path: NVMe offload needs libaio for DeepSpeed's async I/O op; "
                                 "install it (apt-get install libaio-dev, or yum install libaio-devel), or remove "
                                 "offload_nvme_path to offload to CPU memory")
    if p.backend == "deepspeed" and cfg.peft.method == "qlora":
        raise ShardtuneError("peft.method: qlora needs parallel.backend=fsdp2 (its torchao NF4 weights shard under "
                             "FSDP2 only); set parallel.backend=fsdp2, or use peft.method=lora with deepspeed")
    if p.backend == "deepspeed" and cfg.optim.name == "adamw8bit":
        raise ShardtuneError("optim.name: adamw8bit needs parallel.backend=fsdp2 (its torchao 8-bit states follow "
                             "FSDP2's sharded parameters); use optim.name=adamw with deepspeed (parallel.offload="
                             "optimizer also saves GPU memory), or parallel.backend=fsdp2")
    if fsdp2 and cfg.optim.fused is True:
        from shardtune.parallel.fsdp2 import uses_sharded_scaler

        if uses_sharded_scaler(p, cfg.train.precision):
            raise ShardtuneError("optim.fused: true cannot run with train.precision=fp16 under FSDP2 sharding (fused "
                                 "AdamW fails on the sharded gradient scaler's overflow flag); set optim.fused=auto "
                                 "(foreach AdamW then), or train.precision=bf16")
    if fsdp2 and cfg.deepspeed:
        raise ShardtuneError(f"deepspeed: the section is set ({', '.join(cfg.deepspeed)}) but parallel.backend is "
                             "fsdp2, which does not read it; set parallel.backend=deepspeed, or remove the section")
    if p.backend == "deepspeed" and p.strategy == "zero3" and p.compile:
        raise ShardtuneError("parallel.compile: torch.compile is not supported with DeepSpeed zero3 here (its "
                             "parameter gather hooks break the compiled blocks); set parallel.compile=false, or use "
                             "parallel.backend=fsdp2")


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


def _async_io_available() -> bool:
    """Whether DeepSpeed's async I/O op (NVMe offload) can be built here: it needs libaio."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # deepspeed missing or its probe failing: the import check reports the former
        return False


def _report(cfg: Config, hf_config: Any, tokenizer: Any, world: int, plan: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardtune.data import StepSampler
    from shardtune.data.pipeline import build_data
    from shardtune.models.build import build_on_meta

    t = cfg.train
    data = build_data(cfg.data, tokenizer, t.seq_len, t.seed, builder=True)
    sampler = StepSampler(len(data.train), t.micro_batch_size, t.grad_accum, world, 0, t.seed)
    steps = t.max_steps or sampler.steps_per_epoch * t.epochs
    n_params = sum(p.numel() for p in build_on_meta(hf_config).parameters())
    console = Console()
    if not console.is_terminal:  # piped or logged: keep table columns readable
        console = Console(width=160)
    console.print(_sources_table(data.reports))
    for line in _bad_row_lines(data.reports):
        console.print(line, highlight=False)
    console.print(_data_lines(data, t.seq_len), highlight=False)
    if len(data.train):
        console.print(_rendered_example(data, tokenizer))
    table = Table(title="shardtune validate: OK", show_header=False)
    rows = [
        ("model", f"{hf_config.model_type}, {n_params / 1e6:,.1f}M parameters "
                  f"({cfg.model.path or 'preset ' + str(cfg.model.preset)})"),
        ("strategy", f"{cfg.parallel.strategy} ({cfg.parallel.backend}) on {world} process(es) per node, "
                     f"{t.precision}, activation checkpointing {cfg.parallel.activation_checkpointing}"
                     + (f", offload {cfg.parallel.offload}" if cfg.parallel.offload != "none" else "")),
        ("data", f"{data.stats['train_examples']:,} train / {data.stats['eval_examples']:,} eval examples"
                 + (f", packed into {len(data.train):,} rows" if data.packed else "")),
        ("batch", f"{sampler.global_batch} sequences x {t.seq_len} tokens per step "
                  f"({t.micro_batch_size} per process x {t.grad_accum} accumulation x {world} processes)"),
        ("steps", f"{steps} ({sampler.steps_per_epoch} per epoch)"),
        ("output", t.output_dir),
    ]
    if plan is not None:
        c = plan.chosen()
        rows.insert(2, ("plan", f"{c.memory.total / 2**30:.1f} GiB per GPU of {plan.hardware.memory_bytes / 2**30:.1f} "
                                f"({plan.hardware.name}), {c.time.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU "
                                "predicted (shardtune plan shows every option)"))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


def _sources_table(reports: list[Any]) -> Any:
    from rich.table import Table

    table = Table(title="data sources")
    for col in ("source", "format", "rows", "bad", "examples", "truncated", "dropped", "train", "eval",
                "weight", "cache"):
        table.add_column(col, justify="left" if col in ("source", "format") else "right")
    for r in reports:
        fmt = f"{r.format} ({r.template})" if r.template else r.format
        bad = sum(v["count"] for v in r.bad_rows.values())
        dropped = r.dropped_too_long + r.dropped_no_loss
        table.add_row(r.path, fmt, f"{r.rows_read:,}", f"{bad:,}", f"{r.examples:,}", f"{r.truncated:,}",
                      f"{dropped:,}", f"{r.train_examples:,}", f"{r.eval_examples:,}",
                      "eval" if r.weight == 0 else f"{r.weight:g}", "hit" if r.cache_hit else "built")
    return table


def _bad_row_lines(reports: list[Any]) -> list[str]:
    lines = []
    for r in reports:
        for reason, info in r.bad_rows.items():
            first = ", ".join(info.get("first", []))
            lines.append(f"skipped {info['count']:,} bad rows in {r.path}: {reason} (first: {first})")
        if r.dropped_no_loss:
            lines.append(f"dropped {r.dropped_no_loss:,} examples of {r.path} with no loss token within seq_len")
        if r.dropped_too_long:
            lines.append(f"dropped {r.dropped_too_long:,} examples of {r.path} longer than seq_len "
                         "(data.truncation: drop)")
    return lines


def _data_lines(data: Any, seq_len: int) -> str:
    from shardtune.data.packing import pack_best_fit_decreasing, packing_efficiency

    s = data.stats
    pct = s.get("length_percentiles", {})
    lengths = data.train.examples.lengths if data.packed else data.train.lengths
    if data.packed:
        packed, rows = s["packing_efficiency"], s["packed_rows"]
    else:
        bins = pack_best_fit_decreasing(lengths, seq_len)
        packed, rows = packing_efficiency(lengths, bins, seq_len), len(bins)
    return (f"train tokens per example: p50 {pct.get('p50')}, p90 {pct.get('p90')}, p99 {pct.get('p99')}, "
            f"max {pct.get('max')} (seq_len {seq_len})\n"
            f"real tokens per row: padded {s['padded_efficiency']:.1%} ({len(lengths):,} rows), "
            f"packed {packed:.1%} ({rows:,} rows){'  <- in use' if data.packed else ''}")


def _rendered_example(data: Any, tokenizer: Any) -> Any:
    """The first training example as text, loss-carrying tokens highlighted."""
    from rich.text import Text

    from shardtune.data.formats import loss_runs

    example = data.train.examples[0] if data.packed else data.train[0]
    trainable = [label != -100 for label in example.labels]
    text = Text("example 0 (")
    text.append("⟦loss⟧", style="bold green")
    text.append(" / ")
    text.append("no loss", style="dim")
    text.append("):\n")
    for piece, on in loss_runs(example.input_ids, trainable, tokenizer):
        text.append(f"⟦{piece}⟧" if on else piece, style="bold green" if on else "dim")
    return text
