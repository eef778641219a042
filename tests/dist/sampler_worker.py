"""Run under torchrun by tests/dist/test_sampler.py: the shared token cache and the step sampler across ranks.

    torchrun --nproc-per-node N tests/dist/sampler_worker.py OUT_DIR CACHE_ROOT GRAD_ACCUM [RESUME_STATE]

Local rank 0 builds the tokenized data set (2 encoder processes) while the other ranks poll for it;
then every rank records its micro-batches for two epochs and a checksum of each example it reads, and
checks that its sampler's state_dict (through JSON) resumes at the same indices. With RESUME_STATE
(a state_dict written by another launch) a fresh sampler resumes from it. Rank 0 gathers everything
into OUT_DIR/results-WORLD.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch.distributed as dist

from shardtune.data import cache
from shardtune.data.cache import cached_store
from shardtune.data.sampler import StepSampler
from shardtune.data.types import BadRow, RowItem
from shardtune.dist import clean_exit, init_distributed

MICRO_BATCH = 2
SEED = 3
STATE_AT = 5  # the step whose state_dict is saved


class WordEncoder:
    def __call__(self, row):
        words = row["text"].split()
        if "BAD" in words:
            raise BadRow("marked bad")
        ids = [1] + [4 + sum(w.encode()) % 500 for w in words]
        return ids, [False] + [True] * (len(ids) - 1)


def rows():
    for i in range(230):
        text = " ".join(f"w{(i * 5 + k) % 41}" for k in range(1 + i % 9)) + (" BAD" if i % 23 == 22 else "")
        yield RowItem(f"rows.jsonl:{i + 1}", {"text": text})


def main() -> None:
    out, cache_root, accum = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    resume = json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else None
    ctx = init_distributed()
    cache.SERIAL_WARMUP_S = 0.0  # encoder workers even for this small set (forkserver under torchrun)
    store, hit = cached_store("words", cache_root, rows, WordEncoder(), num_proc=2, strict=False,
                              rank_is_builder=ctx.local_rank == 0, chunk_size=40, poll_s=0.05)
    n = len(store)
    sampler = StepSampler(n, MICRO_BATCH, accum, ctx.world, ctx.rank, SEED, fingerprint="words")
    steps = [sampler.micro_batches(s) for s in range(2 * sampler.steps_per_epoch + 1)]
    checksums = {}
    for mbs in steps[:sampler.steps_per_epoch]:
        for i in (i for mb in mbs for i in mb):
            ids, trainable = store.example(i)
            checksums[i] = hashlib.sha256(ids.tobytes() + trainable.tobytes()).hexdigest()[:16]
    # the loop's view: run to STATE_AT, save, and resume in a fresh sampler
    for step in range(STATE_AT):
        sampler.micro_batches(step)
        sampler.position = step + 1
    state = json.loads(json.dumps(sampler.state_dict()))
    again = StepSampler(n, MICRO_BATCH, accum, ctx.world, ctx.rank, SEED, fingerprint="words")
    again.load_state_dict(state)
    resumed_same = again.position == STATE_AT and all(
        again.micro_batches(s) == steps[s] for s in range(again.position, len(steps)))
    from_other = None
    if resume is not None:
        other = StepSampler(n, MICRO_BATCH, accum, ctx.world, ctx.rank, SEED, fingerprint="words")
        other.load_state_dict(resume)
        from_other = {"position": other.position,
                      "steps": [other.micro_batches(s) for s in range(other.position, len(steps))]}
    mine = {"rank": ctx.rank, "hit": hit, "num_examples": n, "steps": steps, "checksums": checksums,
            "resumed_same": resumed_same, "from_other": from_other, "state": state,
            "steps_per_epoch": sampler.steps_per_epoch, "bad_rows": store.meta["bad_rows"],
            "encoder_procs": store.meta["num_proc"]}
    gathered: list = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    if ctx.is_main:
        (out / f"results-{ctx.world}.json").write_text(json.dumps(gathered))
    clean_exit(0)


if __name__ == "__main__":
    main()
