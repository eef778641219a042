"""Deterministic distributed sampling, indexed by optimizer step (so resuming at step s needs no state).

A step's global batch depends only on (num_examples, G, seed, step), where
G = micro_batch_size * grad_accum * world_size. How it is cut into micro-batches and ranks does not
change which examples the step sees: one process with grad_accum=4 and two with grad_accum=2 train on
the same examples at every step.

Resuming: ``state_dict()`` records ``position`` (the next step to run) and what fixes the order
(num_examples, G, seed, optional data fingerprint); ``load_state_dict`` checks them and restores the
position, so the resumed run sees exactly the batches of an uninterrupted one. The split of G into
micro_batch_size x grad_accum x world_size may differ on resume (e.g. other GPU count, same G).
"""

from __future__ import annotations

from typing import Any

import torch

from shardtune.errors import ShardtuneError


class StepSampler:
    """Example indices for each optimizer step of one rank.

    Step s (0-based) is in epoch ``s // steps_per_epoch``; the epoch's order is
    ``torch.randperm(num_examples)`` seeded with ``seed + epoch``; the step takes the slice
    ``perm[(s % steps_per_epoch) * G : + G]`` (the remainder of an epoch is dropped). The slice is cut
    into ``grad_accum * world_size`` chunks of ``micro_batch_size`` consecutive indices, and micro-batch
    m of rank r is chunk ``m * world_size + r``.
    """

    STATE_VERSION = 1

    def __init__(self, num_examples: int, micro_batch_size: int, grad_accum: int, world_size: int, rank: int,
                 seed: int, *, fingerprint: str | None = None) -> None:
        if min(micro_batch_size, grad_accum, world_size) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad sampler shape: micro_batch_size={micro_batch_size} grad_accum={grad_accum} "
                             f"world_size={world_size} rank={rank}")
        self.num_examples = num_examples
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.global_batch_size = micro_batch_size * grad_accum * world_size
        self.steps_per_epoch = num_examples // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ShardtuneError(
                f"the training set ({num_examples} examples) is smaller than one global batch of "
                f"{self.global_batch_size} (train.micro_batch_size={micro_batch_size} x train.grad_accum={grad_accum} "
                f"x {world_size} processes); lower train.micro_batch_size, train.grad_accum or parallel.nproc, "
                "or add data")
        self.fingerprint = fingerprint  # of the data (e.g. its cache keys); checked on resume when both set
        self._position = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def position(self) -> int:
        """The next optimizer step to run (0 at the start). The loop sets it to ``step + 1`` once step
        ``step`` is done; ``state_dict()`` saves it and ``load_state_dict`` restores it."""
        return self._position

    @position.setter
    def position(self, step: int) -> None:
        if int(step) < 0:
            raise ValueError(f"position must be >= 0, got {step}")
        self._position = int(step)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to resume from: the next step and the settings the order depends on."""
        return {"version": self.STATE_VERSION, "position": self._position, "epoch": self._position //
                self.steps_per_epoch, "num_examples": self.num_examples, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "fingerprint": self.fingerprint,
                # informational: these may change on resume as long as their product (G) does not
                "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``; ShardtuneError if the resumed run would see another order."""
        if state.get("version") != self.STATE_VERSION:
            raise ShardtuneError(f"cannot resume the data order: sampler state version {state.get('version')!r}, "
                                 f"this shardtune writes version {self.STATE_VERSION}")
        problems = []
        if state["num_examples"] != self.num_examples:
            problems.append(f"the training set had {state['num_examples']} examples and now has "
                            f"{self.num_examples} (data files, data.* subset/weights/eval settings or "
                            "train.seq_len with truncation=drop changed)")
        if state["seed"] != self.seed:
            problems.append(f"train.seed was {state['seed']} and is now {self.seed}")
        if state["global_batch_size"] != self.global_batch_size:
            problems.append(f"the global batch was {state['global_batch_size']} sequences and is now "
                            f"{self.global_batch_size} (train.micro_batch_size={self.micro_batch_size} x "
                            f"train.grad_accum={self.grad_accum} x {self.world_size} processes); keep the product")
        if (state.get("fingerprint") is not None and self.fingerprint is not None
                and state["fingerprint"] != self.fingerprint):
            problems.append("the tokenized training data changed (same size, other content)")
        if problems:
            raise ShardtuneError("cannot resume with the same data order: " + "; ".join(problems))
        self.position = int(state["position"])

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:  # cache: every step of an epoch uses the same permutation
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_examples, generator=g)
            self._perm_epoch = epoch
        return self._perm

    @property
    def global_batch(self) -> int:
        """Alias of ``global_batch_size`` (sequences per optimizer step over all ranks)."""
        return self.global_batch_size

    def epoch_of(self, step: int) -> int:
        """The 0-based epoch that optimizer step ``step`` falls in."""
        return step // self.steps_per_epoch

    def step_indices(self, step: int) -> list[int]:
        """All G example indices of a step, across every rank and micro-batch, in chunk order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        perm = self._permutation(self.epoch_of(step))
        start = (step % self.steps_per_epoch) * self.global_batch_size
        return perm[start:start + self.global_batch_size].tolist()

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's ``grad_accum`` micro-batches (each ``micro_batch_size`` indices) for ``step``."""
        idx = self.step_indices(step)
        b = self.micro_batch_size
        chunks = [idx[c * b:(c + 1) * b] for c in range(self.grad_accum * self.world_size)]
        return [chunks[m * self.world_size + self.rank] for m in range(self.grad_accum)]


def eval_batches(num_examples: int, micro_batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """This rank's eval micro-batches: a strided share (indices rank, rank + world_size, ...) in chunks.

    Contract: every rank gets exactly ``eval_num_batches(num_examples, micro_batch_size, world_size)``
    lists, so all ranks run the same number of forward passes (FSDP collectives must line up). Each
    list has at most ``micro_batch_size`` indices; a rank with a smaller share gets a shorter last list
    and/or trailing empty lists ``[]``. For those the caller still runs a forward pass, e.g. on
    ``collate(examples, seq_len, pad_id, batch_size=micro_batch_size)``, which fills with all-padding
    rows that carry no loss. Across ranks every example appears exactly once.
    """
    if micro_batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad eval shape: micro_batch_size={micro_batch_size} world_size={world_size} rank={rank}")
    mine = list(range(rank, num_examples, world_size))
    out = [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    return out + [[] for _ in range(eval_num_batches(num_examples, micro_batch_size, world_size) - len(out))]


def eval_num_batches(num_examples: int, micro_batch_size: int, world_size: int) -> int:
    """Eval forward passes per rank: the most any rank needs (rank 0's share is the largest)."""
    per_rank = -(-num_examples // world_size)  # ceil
    return -(-per_rank // micro_batch_size)
