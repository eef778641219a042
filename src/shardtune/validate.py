"""`shardtune validate`: every check that needs no GPU and no process group, before a run starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.config import Config, load_config
from shardtune.errors import ShardtuneError


def validate(path: str, overrides: list[str], *, nproc_flag: int | str | None = None, quiet: bool = False) -> Config:
    """Check config, model, tokenizer and data files. With quiet=False also tokenise the data and
    print a summary. Raises ShardtuneError (exit code 2) on the first problem."""
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
    for key in ("train_file", "eval_file"):
        file = getattr(cfg.data, key)
        if file is not None and not Path(file).is_file():
            raise ShardtuneError(f"data.{key}: {file!r} does not exist; give the path of a JSONL file")
    tokenizer = load_tokenizer(cfg.model.path)
    check_vocab(tokenizer, hf_config)
    world = resolve_nproc(nproc_flag, cfg.parallel.nproc)
    if quiet:
        return cfg
    _report(cfg, hf_config, tokenizer, world)
    return cfg


def _report(cfg: Config, hf_config: Any, tokenizer: Any, world: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardtune.data import StepSampler, build_datasets
    from shardtune.models.build import build_on_meta

    t = cfg.train
    train_set, eval_set = build_datasets(cfg.data, tokenizer, t.seq_len, t.seed)
    sampler = StepSampler(len(train_set), t.micro_batch_size, t.grad_accum, world, 0, t.seed)
    steps = t.max_steps or sampler.steps_per_epoch * t.epochs
    n_params = sum(p.numel() for p in build_on_meta(hf_config).parameters())
    table = Table(title="shardtune validate: OK", show_header=False)
    rows = [
        ("model", f"{hf_config.model_type}, {n_params / 1e6:,.1f}M parameters "
                  f"({cfg.model.path or 'preset ' + str(cfg.model.preset)})"),
        ("strategy", f"{cfg.parallel.strategy} ({cfg.parallel.backend}) on {world} process(es) per node, "
                     f"{t.precision}, activation checkpointing {cfg.parallel.activation_checkpointing}"),
        ("data", f"{len(train_set):,} train / {len(eval_set):,} eval examples from {cfg.data.train_file}"),
        ("batch", f"{sampler.global_batch} sequences x {t.seq_len} tokens per step "
                  f"({t.micro_batch_size} per process x {t.grad_accum} accumulation x {world} processes)"),
        ("steps", f"{steps} ({sampler.steps_per_epoch} per epoch)"),
        ("output", t.output_dir),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
