"""Data: JSONL loading, prompt-masked tokenization, fixed-shape batches and step-indexed sampling."""

from shardtune.data.batch import IGNORE_INDEX, Batch, Example, collate
from shardtune.data.jsonl import build_datasets, load_examples, resolve_format, split_indices, tokenize_example
from shardtune.data.sampler import StepSampler, eval_batches, eval_num_batches

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "Example",
    "StepSampler",
    "build_datasets",
    "collate",
    "eval_batches",
    "eval_num_batches",
    "load_examples",
    "resolve_format",
    "split_indices",
    "tokenize_example",
]
