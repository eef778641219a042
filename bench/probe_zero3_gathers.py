"""DeepSpeed ZeRO-3: which weights are all-gathered, how often, in which micro-batch (fiftieth session).

    python -m torch.distributed.run --nproc-per-node 2 bench/probe_zero3_gathers.py OUT VARIANT [GRAD_ACCUM]

Runs one variant of tests/dist/worker.py (e.g. `zero3:ds:ac:nopersist`, `zero3:ds:ac:tile:nopersist`; on GPUs add
nothing, the worker picks NCCL where CUDA is) with DeepSpeed's `PartitionedParameterCoordinator` wrapped so each
gather of a partitioned weight is logged with the micro-batch it served (training or evaluation forward). Rank 0
writes OUT/gathers.json and prints, per micro-batch, the weight elements gathered, and, per parameter, its gathers
in the first and in the last training step. On 2 gloo processes with micro-llama every parameter is gathered twice
per micro-batch from step 2 on (the planner's count); step 1, while DeepSpeed records its trace of the module
order, gathers each block's weights a third time (bench/RESULTS.md, fiftieth session)."""

from __future__ import annotations

import collections
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

WORKER = Path(__file__).resolve().parents[1] / "tests" / "dist" / "worker.py"
EVENTS: list[tuple[str, int, bool, int, bool]] = []  # (name, elements, forward hook, micro-batch, training)
NAMES: dict[int, str] = {}
NOW = {"micro_batch": -1, "training": False}


def _count_root_calls(module: torch.nn.Module, args: Any) -> None:
    if type(module).__name__.endswith("ForCausalLM"):
        NOW["micro_batch"] += 1
        NOW["training"] = module.training


def _install() -> None:
    gather = ppc.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_
    initialize = deepspeed.initialize

    def logged_gather(self: Any, params: Any, forward: bool, quantize: bool = False) -> Any:
        for p in params:
            if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                EVENTS.append((NAMES.get(p.ds_id, str(p.ds_id)), p.ds_numel, forward, NOW["micro_batch"],
                               NOW["training"]))
        return gather(self, params, forward, quantize)

    def named_initialize(*args: Any, **kwargs: Any) -> Any:
        out = initialize(*args, **kwargs)
        NAMES.update({p.ds_id: n for n, p in kwargs["model"].named_parameters()})
        EVENTS.clear()  # one variant: what its load gathered is not training
        NOW["micro_batch"] = -1
        return out

    ppc.PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_ = logged_gather
    deepspeed.initialize = named_initialize
    torch.nn.modules.module.register_module_forward_pre_hook(_count_root_calls)


def report(events: list[tuple[str, int, bool, int, bool]], grad_accum: int) -> None:
    per_batch: dict[int, list] = collections.defaultdict(lambda: [0, False])
    for _, numel, _, batch, training in events:
        per_batch[batch][0] += numel
        per_batch[batch][1] = training
    print("micro-batch  training  elements gathered")
    for batch, (numel, training) in sorted(per_batch.items()):
        print(f"{batch:11d}  {training!s:8}  {numel:,}")
    train = sorted(b for b, (_, t) in per_batch.items() if t)
    first, last = set(train[:grad_accum]), set(train[-grad_accum:])
    counts = collections.defaultdict(lambda: [0, 0])
    for name, _, _, batch, _ in events:
        counts[name][0] += batch in first
        counts[name][1] += batch in last
    print("\nparameter  gathers in the first step / in the last step")
    for name, (a, b) in counts.items():
        print(f"{name}  {a} / {b}")


def main() -> None:
    import shardtune.dist

    out, variant = Path(sys.argv[1]), sys.argv[2]
    grad_accum = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    _install()
    end = shardtune.dist.clean_exit

    def report_then_exit(code: int) -> None:  # the worker ends its process itself (os._exit): report first
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "gathers.json").write_text(json.dumps(EVENTS))
            report(EVENTS, grad_accum)
        end(code)

    shardtune.dist.clean_exit = report_then_exit  # read by the worker's own import, below
    sys.argv = [str(WORKER), str(out), str(grad_accum), variant]
    runpy.run_path(str(WORKER), run_name="__main__")


if __name__ == "__main__":
    main()
