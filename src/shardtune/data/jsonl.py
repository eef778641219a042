"""JSONL loading, tokenization with prompt masking, and the train/eval split."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from shardtune.config import DataConfig
from shardtune.data.batch import IGNORE_INDEX, Example
from shardtune.errors import ShardtuneError

log = logging.getLogger(__name__)


def resolve_format(row: dict[str, Any], cfg: DataConfig) -> str:
    """``text`` or ``prompt_completion``; ``auto`` looks for both prompt and completion fields in ``row``."""
    if cfg.format != "auto":
        return cfg.format
    return "prompt_completion" if cfg.prompt_field in row and cfg.completion_field in row else "text"


def load_examples(path: str, cfg: DataConfig) -> list[dict[str, str]]:
    """Read a JSONL file into rows holding only the fields of its format (decided once, by the first row).

    Returned rows contain exactly ``{cfg.prompt_field, cfg.completion_field}`` or ``{cfg.text_field}``, so
    ``tokenize_example`` with ``format: auto`` reads each row the same way. Blank lines are skipped.
    Raises ShardtuneError naming the file and line for a missing file, invalid JSON or a bad field.
    """
    p = Path(path)
    if not p.is_file():
        raise ShardtuneError(f"data file {path!r} does not exist; set data.train_file / data.eval_file to a JSONL file")
    rows: list[dict[str, str]] = []
    fields: tuple[str, ...] = ()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ShardtuneError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise ShardtuneError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            if not fields:
                fmt = resolve_format(row, cfg)
                fields = (cfg.prompt_field, cfg.completion_field) if fmt == "prompt_completion" else (cfg.text_field,)
            for name in fields:
                if name not in row:
                    hint = (f" (format {cfg.format}: expected {cfg.prompt_field!r}+{cfg.completion_field!r} "
                            f"or {cfg.text_field!r})" if cfg.format == "auto" else "")
                    raise ShardtuneError(f"{where}: missing field {name!r}{hint}")
                if not isinstance(row[name], str):
                    raise ShardtuneError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
            rows.append({name: row[name] for name in fields})
    if not rows:
        raise ShardtuneError(f"data file {path!r} has no examples")
    return rows


def tokenize_example(example: dict[str, str], tokenizer: Any, cfg: DataConfig,
                     seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one row: ``[bos] + prompt + completion + [eos]``, truncated to ``seq_len``.

    bos is prepended when the tokenizer has one (no loss on it); eos is appended when ``cfg.add_eos``
    and carries loss. Text rows: loss on every token. Prompt/completion rows: -100 on prompt tokens.
    Prompt and completion are encoded separately (``add_special_tokens=False``) and concatenated, so
    the loss boundary is exact. Truncation drops tokens from the right end.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if cfg.add_eos and tokenizer.eos_token_id is not None else []
    if resolve_format(example, cfg) == "prompt_completion":
        prompt = bos + tokenizer.encode(example[cfg.prompt_field], add_special_tokens=False, verbose=False)
        target = tokenizer.encode(example[cfg.completion_field], add_special_tokens=False, verbose=False) + eos
        input_ids = prompt + target
        labels = [IGNORE_INDEX] * len(prompt) + target
    else:
        input_ids = bos + tokenizer.encode(example[cfg.text_field], add_special_tokens=False, verbose=False) + eos
        # bos is at position 0, which is never a target after the shift; -100 makes that explicit.
        labels = [IGNORE_INDEX] * len(bos) + input_ids[len(bos):]
    return input_ids[:seq_len], labels[:seq_len]


def _tokenize_all(rows: list[dict[str, str]], tokenizer: Any, cfg: DataConfig, seq_len: int,
                  what: str) -> list[Example]:
    out = []
    for row in rows:
        ex = Example(*tokenize_example(row, tokenizer, cfg, seq_len))
        if ex.num_target_tokens > 0:
            out.append(ex)
    dropped = len(rows) - len(out)
    if dropped:
        log.warning("%s: dropped %d of %d examples with no loss token within seq_len=%d",
                    what, dropped, len(rows), seq_len)
    return out


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) row indices, both in file order; at least 1 eval row when fraction > 0.

    The eval rows are a seeded random choice, so they do not depend on tokenizer or seq_len.
    With a single row and fraction > 0 that row goes to train and eval is empty.
    """
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [i for i in range(n) if i not in held], sorted(held)


def build_datasets(cfg: DataConfig, tokenizer: Any, seq_len: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Tokenized (train, eval) examples; eval from ``cfg.eval_file`` or held out from ``cfg.train_file``.

    Examples with no loss token after truncation are dropped (logged). Raises ShardtuneError when no
    train example is left.
    """
    rows = load_examples(cfg.train_file, cfg)
    if cfg.eval_file:
        train_rows, eval_rows = rows, load_examples(cfg.eval_file, cfg)
    else:
        train_idx, eval_idx = split_indices(len(rows), cfg.eval_fraction, seed)
        train_rows, eval_rows = [rows[i] for i in train_idx], [rows[i] for i in eval_idx]
    train = _tokenize_all(train_rows, tokenizer, cfg, seq_len, cfg.train_file)
    evals = _tokenize_all(eval_rows, tokenizer, cfg, seq_len, cfg.eval_file or f"{cfg.train_file} (eval split)")
    if not train:
        raise ShardtuneError(f"data.train_file {cfg.train_file!r}: no example has a loss token within "
                             f"train.seq_len={seq_len}; raise train.seq_len or shorten the prompts")
    return train, evals
