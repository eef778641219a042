"""`shardtune validate`: every check that needs no GPU and no process group, before a run starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.checkpoint.outdir import check_final_dir
from shardtune.config import Config, load_config
from shardtune.errors import ShardtuneError


def validate(path: str, overrides: list[str], *, nproc_flag: int | str | None = None, quiet: bool = False,
             nnodes: int = 1, hardware: Any = None, force: bool = False, overwrite: bool = False) -> Config:
    """Check config, model, tokenizer and data (tokenised into the cache, so the workers that follow
    find it there), that one global batch fits the data, that a checkpoint to resume from suits the
    run (`nnodes` nodes of the processes `nproc_flag` gives), and that the run's final model/adapter folder
    may be written (`overwrite`: train --overwrite). With quiet=False print a report.
    With `hardware` (the local GPU, or one named with --gpu) the planner refuses a run predicted not to fit
    (unless `force`); `auto` strategy / micro-batch are replaced by its pick. Returns the resolved config.
    Raises ShardtuneError (exit code 2) on the first problem."""
    from shardtune.dist import device_type
    from shardtune.launch import resolve_nproc
    from shardtune.models.build import load_hf_config
    from shardtune.models.tokenizer import check_vocab, load_tokenizer

    cfg = load_config(path, overrides)
    hf_config = load_hf_config(cfg.model)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos and cfg.train.seq_len > max_pos:
        raise ShardtuneError(f"train.seq_len: {cfg.train.seq_len} exceeds the model's max_position_embeddings "
                             f"({max_pos}); set train.seq_len <= {max_pos}, or raise the positions with "
                             f"model.max_position_embeddings={cfg.train.seq_len} and a model.rope_scaling")
    paths = [("data.train_file", cfg.data.train_file), ("data.eval_file", cfg.data.eval_file),
             *((f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources))]
    for key, path in paths:
        if path is not None and not Path(path).exists():
            raise ShardtuneError(f"{key}: {path!r} does not exist; give a data file or folder")
    world = resolve_nproc(nproc_flag, cfg.parallel.nproc)
    if nnodes < 1:
        raise ShardtuneError(f"--nnodes {nnodes}: expected a positive integer")
    plan = None
    from shardtune.plan import auto_keys

    if hardware is not None or auto_keys(cfg):
        from shardtune.plan import resolve_auto

        cfg, plan = resolve_auto(cfg, hf_config, hardware, world=world * nnodes, per_node=world, force=force)
    check_combination(cfg, world, device=device_type(), nnodes=nnodes)
    from shardtune.parallel import check_weights_on_host

    check_weights_on_host(cfg, hf_config)
    from shardtune.models.liger_rules import check_liger, head_adapted

    check_liger(cfg.model.liger, device_type(), hf_config.model_type,
                adapted_head=head_adapted(cfg.peft.method, cfg.peft.target_modules))
    from shardtune.models.float8 import check_float8

    check_float8(cfg, device_type())
    check_memory_snapshot(cfg, device_type())
    check_trackers(cfg)
    check_output_dir(cfg.train.output_dir)
    check_final_dir(cfg, overwrite)
    if cfg.model.path:
        check_weight_files(Path(cfg.model.path))
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    check_vocab(tokenizer, hf_config)
    resume = check_resume(cfg, world * nnodes, verify=True)
    if resume is not None:  # the workers get the checkpoint read back here, not `auto` to resolve again
        cfg = cfg.model_copy(deep=True)
        cfg.checkpoint.resume = str(resume.resolve())
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
        StepSampler(len(data.train), t.micro_batch_size, t.grad_accum, world * nnodes, 0, t.seed)
        return cfg
    _report(cfg, hf_config, tokenizer, world, plan, nnodes=nnodes)
    return cfg


def check_trackers(cfg: Config) -> None:
    """A tracker the config turns on (log.tensorboard / wandb / mlflow) must be installed: refused before start."""
    import importlib.util

    from shardtune.metrics.trackers import PACKAGES, configured

    for name in configured(cfg.log):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ShardtuneError(f"log.{name}: the {PACKAGES[name]} package is not installed; pip install "
                                 f"{PACKAGES[name]}, or remove log.{name}")


def check_memory_snapshot(cfg: Config, device: str) -> None:
    """log.memory_snapshot records PyTorch's CUDA allocator: refused on other devices, and with compiled blocks
    under activation checkpointing from PyTorch 2.11 on, where recording the allocator's history makes the
    recompute of a compiled block fail ("SystemError: <built-in method apply of FunctionMeta object> returned
    NULL": pytorch/pytorch#179536, a regression of 2.11; seen on one H200 with 8B LoRA and QLoRA)."""
    if cfg.log.memory_snapshot is None:
        return
    if device != "cuda":
        raise ShardtuneError(f"log.memory_snapshot: records PyTorch's CUDA allocator, and this run is on {device}; "
                             "remove log.memory_snapshot (or run on GPUs)")
    import torch

    from shardtune.plan import snapshot_breaks_recompute

    if cfg.parallel.compile and snapshot_breaks_recompute(cfg.log.memory_snapshot,
                                                          cfg.parallel.activation_checkpointing):
        raise ShardtuneError(f"log.memory_snapshot: PyTorch {torch.__version__.split('+')[0]} fails in the "
                             "recompute of compiled blocks while it records (pytorch/pytorch#179536); record with "
                             "parallel.compile=false or parallel.activation_checkpointing=none, or remove "
                             "log.memory_snapshot")


def check_output_dir(output_dir: str) -> None:
    """The run directory must be a folder, or creatable: its nearest existing parent a folder."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ShardtuneError(f"train.output_dir: {output_dir!r} is a file, not a folder; give a folder path "
                             "(--output-dir DIR)")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ShardtuneError(f"train.output_dir: cannot create {output_dir!r}: {str(parent)!r} is a file; give "
                             "another --output-dir")


def check_weight_files(model_dir: Path) -> None:
    """Each safetensors file of the model is whole: its header parses and its tensors end where the file ends
    (reads the headers only). A truncated download or a damaged file stops here with its name, not as a
    traceback from every rank when the workers load it."""
    import json
    import struct

    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with f.open("rb") as handle:
                (n,) = struct.unpack("<Q", handle.read(8))
                if n > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(handle.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as err:
            raise ShardtuneError(f"model.path: {str(f)!r} is not a valid safetensors file ({err}); the file is "
                                 "damaged or cut short: copy or download it again") from None
        if 8 + n + end != size:
            raise ShardtuneError(f"model.path: {str(f)!r} is truncated or corrupt ({size:,} bytes, its header "
                                 f"says {8 + n + end:,}); copy or download it again")


def check_combination(cfg: Config, world: int | None = None, *, device: str | None = None,
                      candidate: bool = False, nnodes: int = 1) -> None:
    """Settings that cannot work together (parallel.check_combination), refused before any process starts.
    `world`: processes per node, on `nnodes` nodes. `candidate`: without importing an installed backend package
    (`plan`)."""
    from shardtune.parallel import check_combination as check

    check(cfg, world, device=device, candidate=candidate, nnodes=nnodes)


def check_worker(cfg: Config, world: int) -> None:
    """The checks of `validate` that need no data, again in each worker: a run that torchrun started
    directly (`torchrun -m shardtune train ...`) had no launcher to run `validate` first. `world`: all
    processes."""
    from shardtune.dist import device_type
    from shardtune.plan import auto_keys

    if not auto_keys(cfg):  # else the loop's planner resolves `auto`, and it picks only combinations that run
        check_combination(cfg, device=device_type())
    check_memory_snapshot(cfg, device_type())
    check_trackers(cfg)
    if cfg.model.liger is True or cfg.model.liger == "loss":
        from shardtune.models.build import load_hf_config
        from shardtune.models.liger_rules import check_liger, head_adapted

        check_liger(cfg.model.liger, device_type(), load_hf_config(cfg.model).model_type,
                    adapted_head=head_adapted(cfg.peft.method, cfg.peft.target_modules))
    if cfg.train.float8:
        from shardtune.models.float8 import check_float8

        check_float8(cfg, device_type())
    check_resume(cfg, world)


def check_resume(cfg: Config, world: int, *, verify: bool = False) -> Path | None:
    """A checkpoint the run resumes from (`checkpoint.resume`) must exist, be complete (with `verify`: every
    file read back against the manifest's checksums; `auto` falls back past damaged ones), and be one this
    backend can resume on `world` processes (all nodes). Returns it (None: nothing to resume)."""
    from shardtune.checkpoint.formats import check_resumable
    from shardtune.checkpoint.layout import checkpoint_root, resolve_checkpoint

    if not cfg.checkpoint.resume:
        return None
    path = resolve_checkpoint(cfg.checkpoint.resume, checkpoint_root(cfg.checkpoint, cfg.train.output_dir),
                              check=verify)
    if path is not None:
        check_resumable(path, cfg.parallel.backend, world)
        check_model_fits(path, cfg)
    return path


def check_model_fits(path: Path, cfg: Config) -> None:
    """The checkpoint's model tensors must be this run's: same names (a saved tensor the model lacks: fewer
    layers, full fine-tuning vs adapters) and same shapes (hidden size, vocabulary, LoRA rank). Checked from the
    checkpoint's metadata and the model built on the meta device, so a changed config stops here with one line
    instead of as a size-mismatch traceback from every worker. DCP checkpoints only: DeepSpeed's resume only on
    the same processes and backend, which its own load checks."""
    from shardtune.checkpoint.dcp_files import model_tensors
    from shardtune.checkpoint.formats import stored_format
    from shardtune.models.build import build_on_meta, load_hf_config

    if stored_format(path) != "dcp" or not (path / ".metadata").is_file():  # no metadata: verify names it damaged
        return
    saved = {name: tuple(meta.size) for name, meta in model_tensors(path).items()}
    hf_config = load_hf_config(cfg.model)
    model = build_on_meta(hf_config)
    if cfg.peft.method in ("lora", "qlora"):
        from shardtune.peft.lora import apply_lora

        model = apply_lora(model, cfg.peft, hf_config.model_type)
    current = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}  # tied too
    current.update({name: tuple(b.shape) for name, b in model.named_buffers()})
    fix = (f"resume with the model and peft settings it was trained with (its run's config.yaml), or start a new "
           f"run without --resume (`shardtune export {path} DIR` makes a model folder of it)")
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise ShardtuneError(f"checkpoint {path} holds {len(unknown)} tensor(s) this model does not have (e.g. "
                             f"{unknown[0]}): it was trained with another model or peft setting; {fix}")
    for name, shape in sorted(saved.items()):
        if current[name] != shape:
            raise ShardtuneError(f"checkpoint {path} does not fit this model: {name} is {list(shape)} there and "
                                 f"{list(current[name])} here; {fix}")


def _report(cfg: Config, hf_config: Any, tokenizer: Any, world: int, plan: Any = None, *, nnodes: int = 1) -> None:
    """What validate found; `world`: processes per node, on `nnodes` nodes."""
    from rich.console import Console
    from rich.table import Table

    from shardtune.data import StepSampler
    from shardtune.data.pipeline import build_data
    from shardtune.models.build import build_on_meta

    t = cfg.train
    data = build_data(cfg.data, tokenizer, t.seq_len, t.seed, builder=True)
    sampler = StepSampler(len(data.train), t.micro_batch_size, t.grad_accum, world * nnodes, 0, t.seed)
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
        ("strategy", f"{cfg.parallel.strategy} ({cfg.parallel.backend}) on {world} process(es) per node"
                     + (f" x {nnodes} nodes" if nnodes > 1 else "") + ", "
                     f"{t.precision}, activation checkpointing {cfg.parallel.activation_checkpointing}"
                     + (f", offload {cfg.parallel.offload}" if cfg.parallel.offload != "none" else "")),
        ("data", f"{data.stats['train_examples']:,} train / {data.stats['eval_examples']:,} eval examples"
                 + (f", packed into {len(data.train):,} rows" if data.packed else "")),
        ("batch", f"{sampler.global_batch} sequences x {t.seq_len} tokens per step "
                  f"({t.micro_batch_size} per process x {t.grad_accum} accumulation x {world * nnodes} processes)"),
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
