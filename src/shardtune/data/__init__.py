"""Data: sources, chat templates and loss masks, tokenization cache, packing, step-indexed sampling.

The pipeline (shardtune.data.pipeline.build_data) joins the stages; this package's top level
exports the light pieces the loop uses per step.
"""

from shardtune.data.batch import IGNORE_INDEX, Batch, Example, collate, to_device
from shardtune.data.sampler import StepSampler, eval_batches, eval_num_batches

__all__ = ["IGNORE_INDEX", "Batch", "Example", "StepSampler", "collate", "eval_batches", "eval_num_batches",
           "to_device"]
