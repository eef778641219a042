"""check_shared_root on a real gloo group, each process standing for a node of its own (local world 1): a folder
every "node" sees passes; a folder that differs per node is refused on every rank. Results to OUT/shared-R.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from shardtune.checkpoint.checkpointer import check_shared_root
from shardtune.dist import clean_exit, init_distributed
from shardtune.errors import ShardtuneError

out = Path(sys.argv[1])
ctx = init_distributed()
results = {}
for case, root in [("shared", out / "shared"), ("per-node", out / f"node{ctx.rank}")]:
    try:
        check_shared_root(root, ctx, local_world=1)
        results[case] = "ok"
    except ShardtuneError as err:
        results[case] = str(err)
results["leftover"] = sorted(p.name for p in (out / "shared").iterdir())  # the marker is removed
(out / f"shared-{ctx.rank}.json").write_text(json.dumps(results))
dist.barrier()
clean_exit(0)
