"""Run under torchrun by the dist tests: several training variants in one process group.

    torchrun --nproc-per-node N tests/dist/worker.py OUT_DIR GRAD_ACCUM VARIANT [VARIANT ...]

A variant is `strategy[:option...]`, options: bf16, fp16, ac (activation checkpointing), compile, packed
(data.packing, seq_len 64), dir (load $SHARDTUNE_TEST_MODEL_DIR), lora, qlora, adamw8bit, ds
(parallel.backend=deepspeed), offload / offparams / nvme (DeepSpeed offload of the optimizer / of parameters and
optimizer), s2 (parallel.shard_size=2, for hsdp), local (parallel.shard_frozen=false), noclip
(optim.max_grad_norm=0, lr 1e-2), mb8 / mb1 (micro-batch 8 x accumulation 1 / micro-batch 1 x accumulation 4), aot
(torch.compile with the aot_eager backend: Dynamo's graphs and AOTAutograd's partition without Inductor's C++, as
conftest's `without_inductor`), fused (model.liger: loss, with the fused loss's plain-torch contract for Liger's
kernel: `reference_fused_loss`). For each variant rank 0 records the loss and grad-norm (before clipping)
trajectories, facts that prove a feature was on (`Probe`: block recomputes, activation dtypes, document masks;
compiled graphs, NF4 parameters, optimizer state types, the DeepSpeed stage), whether every parameter is a DTensor
sharded on dim 0, and the largest logit difference between the trained (sharded) model and the Hugging Face
directory it exported, reloaded with transformers, and the run's communication accounting (summary.json's `comm`)
with the model's element counts; for every rank, what its load read and the most it materialised at once
(`LoadProbe`, around the run's weight source). Results go to OUT_DIR/results.json. One launch for many variants:
start-up costs ~3 s per launch on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import shardtune.train.loop
from shardtune.assemble import BuiltModel, assemble
from shardtune.config import config_from_dict
from shardtune.data import Batch
from shardtune.dist import clean_exit, init_distributed
from shardtune.train.loop import run_training

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    # The 0.13M-parameter preset: parity, sharding and feature checks do not depend on the model's size.
    "model": {"preset": "micro-llama"},
    "data": {"train_file": str(ROOT / "examples" / "data" / "tasks.jsonl"), "eval_fraction": 0.02},
    "train": {"precision": "fp32", "lr": 1e-3, "max_steps": 6, "micro_batch_size": 2, "seq_len": 24,
              "eval_batches": 2},
    "optim": {"warmup_steps": 2, "weight_decay": 0.01},
    "log": {"every": 1, "progress": False, "report": False},
}
OPTIONS = {"bf16": "train.precision=bf16", "fp16": "train.precision=fp16",
           "ac": "parallel.activation_checkpointing=full", "compile": "parallel.compile=true",
           "around": "parallel.checkpoint_in_compile=false",
           "budget": "parallel.activation_memory_budget=0.3",
           "actoff": "parallel.activation_offload=true",
           "cb1": "parallel.checkpoint_blocks=1",
           "tile": "parallel.tiled_mlp=16",  # 2 x 24 tokens a micro-batch: three tiles
           "packed": "data.packing=true train.seq_len=64",
           "lora": "peft.method=lora peft.r=8 peft.alpha=16",
           "qlora": "peft.method=qlora peft.r=8 peft.alpha=16",
           "adamw8bit": "optim.name=adamw8bit",
           "ds": "parallel.backend=deepspeed",
           "offload": "parallel.offload=optimizer",
           "offparams": "parallel.offload=params",
           "nvme": "parallel.offload=optimizer parallel.offload_nvme_path={nvme_dir}",
           "s2": "parallel.shard_size=2",
           "local": "parallel.shard_frozen=false",
           # Clipping off and a 10x learning rate: the clipped runs hide a gradient-scale error from the loss.
           "noclip": "optim.max_grad_norm=0 train.lr=1e-2",
           # Other splits of the same global batch of 8 (the launch's grad_accum is overridden).
           "mb8": "train.micro_batch_size=8 train.grad_accum=1",
           "mb1": "train.micro_batch_size=1 train.grad_accum=4",
           # Weights from the HF directory in $SHARDTUNE_TEST_MODEL_DIR instead of the preset.
           "dir": "model.preset=null model.path={model_dir}",
           # micro-llama with its own LM head (the 8B shapes' kind) from $SHARDTUNE_TEST_UNTIED_DIR.
           "untied": "model.preset=null model.path={untied_dir}",
           # ZeRO-3 partitions and releases every weight (by default one under 100k elements, all of micro-llama's,
           # stays whole on every rank).
           "nopersist": "deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
           "aot": "",  # no override: the compile backend (`compile_backend`)
           "fused": "model.liger=loss"}  # with `reference_fused_loss` standing in for Liger's kernel


def _is_block(module: torch.nn.Module) -> bool:
    # FSDP2 swaps in a subclass (FSDPLlamaDecoderLayer), so the class name, not the class, identifies a block.
    return "DecoderLayer" in type(module).__name__


def _is_block_body(module: torch.nn.Module) -> bool:
    # transformers 5 checkpoints a block's `forward`, not its `__call__` (so FSDP2's hooks run once): the block's
    # own hooks fire once either way, the hooks of a module inside it (its MLP) fire again in the recompute. Its
    # forward PRE hook: the recompute stops early (torch.utils.checkpoint's early stop) once the last tensor the
    # backward needs exists, which is inside the MLP (down_proj's input), so the MLP never returns there.
    return type(module).__name__.endswith("MLP")


def _is_root(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("ForCausalLM")


class Probe:
    """What the model saw during training steps, through global module hooks (no change to the code under test):
    calls of the blocks' MLPs (activation checkpointing runs each twice: forward and recompute), the
    dtypes of the blocks' outputs, and how many root calls carried a document mask (one that blocks an earlier
    position of the row, which a plain causal mask never does). Eval forwards (eval mode) are not counted."""

    def __init__(self) -> None:
        self.mlp_calls = 0
        self.dtypes: set[str] = set()
        self.doc_masked_calls = 0
        self._roots: set[int] = set()
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
                         torch.nn.modules.module.register_module_forward_hook(self._post)]

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling() and module.training:
            self.mlp_calls += _is_block_body(module)
        # Global hooks get no keyword arguments: the root gets its own hook that does, on its first call.
        if _is_root(module) and id(module) not in self._roots and not torch.compiler.is_compiling():
            self._roots.add(id(module))
            module.register_forward_pre_hook(self._root_kwargs, with_kwargs=True, prepend=True)

    def _root_kwargs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if not module.training or mask is None:
            return
        if type(mask).__name__ == "BlockMask":
            self.doc_masked_calls += 1
        elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
            blocked = ~mask if mask.dtype == torch.bool else mask < 0
            below = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
            self.doc_masked_calls += int(bool((blocked & below).any()))

    def _post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if torch.compiler.is_compiling() or not module.training:
            return
        if not _is_block(module):
            return
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor):
            self.dtypes.add(str(hidden.dtype).removeprefix("torch."))

    def facts(self) -> dict[str, object]:
        return {"mlp_calls": self.mlp_calls, "activation_dtypes": sorted(self.dtypes),
                "doc_masked_calls": self.doc_masked_calls}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _full_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters that hold their whole tensor in memory now: not on the meta device (not given storage
    yet) and not DeepSpeed ZeRO-3 placeholders (an empty tensor, the rank's partition in ds_tensor). A DTensor counts
    its local shard."""
    total = 0
    for p in {id(p): p for p in module.parameters()}.values():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not local.is_meta and type(local) in (torch.Tensor, torch.nn.Parameter):  # NF4 weights: their own type
            total += local.untyped_storage().nbytes()
    return total


class LoadProbe:
    """The run's weight source, observed: every read goes to it unchanged. Records the bytes of the rows each read
    returned (safetensors maps the file and hands out views into it, so what a rank reads from disk is the pages of
    the rows it asked for and copied) and, at each read, the parameter bytes held in full by the model
    (`_full_bytes`): the most it materialised at once while loading. The model's own sizes on the meta device
    (fp32): whole, and per decoder block."""

    def __init__(self, built: BuiltModel) -> None:
        self.source, self.model = built.source, built.model
        self.bytes_read = 0
        self.peak_full_bytes = 0
        meta = {id(p): p.numel() * p.element_size() for p in built.model.parameters()}
        self.model_bytes = sum(meta.values())
        self.block_bytes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in built.blocks]

    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = self.source.rows(name, shape, start, stop, dtype)
        self.bytes_read += rows.numel() * rows.element_size()
        self.peak_full_bytes = max(self.peak_full_bytes, _full_bytes(self.model))
        return rows

    def facts(self) -> dict[str, object]:
        return {"bytes_read": self.bytes_read, "peak_full_bytes": self.peak_full_bytes,
                "model_bytes": self.model_bytes, "block_bytes": self.block_bytes}


PROBES: list[LoadProbe] = []


def _probed_assemble(*args: object, **kwargs: object) -> BuiltModel:
    """The run's own assemble, with its weight source observed by a LoadProbe (appended to PROBES)."""
    built = assemble(*args, **kwargs)
    PROBES.append(LoadProbe(built))
    built.source = PROBES[-1]
    return built


def nf4_params(module: torch.nn.Module) -> int:
    """Parameters stored as torchao NF4 tensors (QLoRA's frozen base), sharded or not."""
    return sum(type(p.to_local() if isinstance(p, DTensor) else p).__name__ == "NF4Tensor"
               for p in module.parameters())


def optimizer_state_types(optimizer: torch.optim.Optimizer) -> list[str]:
    """Type names of the optimizer's state tensors (their local shards): torchao's 8-bit states are their own type."""
    names = set()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step counter
                names.add(type(value.to_local() if isinstance(value, DTensor) else value).__name__)
    return sorted(names)


@contextlib.contextmanager
def compile_backend(backend: str | None) -> Iterator[None]:
    """torch.compile with `backend` inside (None: Inductor, the default). aot_eager traces and partitions as
    Inductor's path does, so what a variant counts of graphs and saved tensors holds, without its C++ build (the
    compiled QLoRA variant: ~60 s of the shared launch on CI's 2 cores, cold)."""
    if backend is None:
        yield
        return
    original = torch.compile
    torch.compile = functools.partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def offload_all(on: bool) -> Iterator[list]:
    """parallel.activation_offload moving every saved activation (micro-llama's are all under the 1 MiB floor a run
    keeps on the device); yields the list the run's ActivationOffload objects join, for their moved_bytes."""
    from shardtune.parallel import prepare

    made: list = []
    if not on:
        yield made
        return
    original = prepare.offload_activations

    def everything(*args, **kwargs):
        made.append(original(*args, **{**kwargs, "min_bytes": 0}))
        return made[-1]

    prepare.offload_activations = everything
    try:
        yield made
    finally:
        prepare.offload_activations = original


@contextlib.contextmanager
def fused_loss_stand_in(on: bool) -> Iterator[list]:
    """model.liger: loss on a CPU: the loop installs models/liger.py's fused-loss forward as on a GPU, with
    `reference_fused_loss` (the fused loss's contract in plain torch) for Liger's Triton kernel; yields the list of
    the LM head weights' [type, element count] it was called with (one per micro-batch: the fused path ran)."""
    import shardtune.models.liger as liger

    calls: list = []
    if not on:
        yield calls
        return

    def loss(weight, hidden, targets):
        calls.append([type(weight).__name__, weight.numel()])
        return liger.reference_fused_loss(weight, hidden, targets)

    saved = shardtune.train.loop.use_liger, liger.liger_loss
    shardtune.train.loop.use_liger = lambda *args: True
    liger.liger_loss = lambda *args: loss
    try:
        yield calls
    finally:
        shardtune.train.loop.use_liger, liger.liger_loss = saved


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def sharding_report(module: torch.nn.Module) -> dict[str, object]:
    params = dict(module.named_parameters())
    dtensors = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    return {
        "all_dtensor": len(dtensors) == len(params),
        "frozen": sum(not p.requires_grad for p in params.values()),
        "frozen_dtensors": sum(not p.requires_grad for p in dtensors.values()),
        "trainable_dtensors": sum(p.requires_grad for p in dtensors.values()),
        "trainable": sum(p.requires_grad for p in params.values()),
        "all_shard0": all(p.placements == (Shard(0),) for p in dtensors.values()),
        "placements": sorted({str(p.placements) for p in dtensors.values()}),
        "mesh": sorted({str(tuple(p.device_mesh.shape)) for p in dtensors.values()}),
        "local_fraction": (sum(p.to_local().numel() for p in dtensors.values()) /
                           max(1, sum(p.numel() for p in dtensors.values()))),
    }


def export_logit_diff(backend, model_dir: str, rank: int) -> float | None:
    ids = torch.randint(4, 264, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    backend.train(False)
    with torch.no_grad():
        trained = backend.forward(batch).float()  # every rank joins (FSDP all-gathers)
    if rank != 0:
        return None
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        reloaded = loaded(input_ids=ids).logits
    return float((trained - reloaded).abs().max())


def base_weights_diff(backend) -> float:
    """Largest change of any frozen (LoRA base) parameter against the preset's initial weights."""
    from shardtune.models.weights import RandomInitSource
    from shardtune.peft.lora import base_name

    source = RandomInitSource(0.02, seed=0)
    worst = 0.0
    for name, p in backend.module.named_parameters():
        if p.requires_grad:
            continue
        full = backend.full_tensor(p)  # collective under sharding: every rank joins
        initial = source.full(base_name(name), full.shape).to(full.dtype)  # stored in peft.base_dtype
        worst = max(worst, float((full.float() - initial.float()).abs().max()))
    return worst


def param_dtypes(module: torch.nn.Module) -> dict[str, list[str]]:
    """Storage dtypes of the trainable and of the frozen parameters (NF4 weights: their own dtype)."""
    out: dict[str, set[str]] = {"trainable": set(), "frozen": set()}
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if type(local).__name__ != "NF4Tensor":
            out["trainable" if p.requires_grad else "frozen"].add(str(local.dtype).removeprefix("torch."))
    return {k: sorted(v) for k, v in out.items()}


def deepspeed_partition_fraction(module: torch.nn.Module) -> float | None:
    """ZeRO-3: share of all parameter elements this rank holds (DeepSpeed's ds_tensor partitions)."""
    params = list(module.parameters())
    if not params or not all(hasattr(p, "ds_tensor") for p in params):
        return None
    return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)


def adapter_logit_diff(backend, adapter_dir: str, rank: int) -> float | None:
    """Logits of the trained model vs the base model + saved adapter, loaded with transformers + peft."""
    ids = torch.randint(4, 264, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    backend.train(False)
    with torch.no_grad():
        trained = backend.forward(batch).float()
    if rank != 0:
        return None
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.environ["SHARDTUNE_TEST_MODEL_DIR"], dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        return float((trained - loaded(input_ids=ids).logits).abs().max())


def model_numel(module: torch.nn.Module) -> dict[str, object]:
    """Whole-model element counts (DTensors count their global shape): all parameters, and each decoder block's."""
    layers = next(m for name, m in module.named_modules() if name.endswith("layers"))
    return {"params": sum(p.numel() for p in module.parameters()),
            "blocks": [sum(p.numel() for p in block.parameters()) for block in layers]}


def logged_fields(output_dir: str) -> dict[str, object]:
    """The monitors' fields (comm_*, per-rank memory, system samples) of metrics.jsonl's last training record
    (rank 0 writes it; {} elsewhere)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    train = [r for r in map(json.loads, path.read_text().splitlines()) if not r.get("eval")]
    monitors = ("comm_", "peak_", "rss_", "gpu_")
    return {k: v for k, v in train[-1].items() if k.startswith(monitors)} if train else {}


def main() -> None:
    out, accum, variants = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    ctx = init_distributed()
    shardtune.train.loop.assemble = _probed_assemble  # observes the weight source; loads through it unchanged
    results = {}
    nvme_dir = out / "nvme"  # DeepSpeed's swap folder for optimizer states (one subfolder per rank)
    if any("nvme" in v.split(":") for v in variants):
        nvme_dir.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        started = time.perf_counter()
        strategy, *opts = variant.split(":")
        extra = " ".join(OPTIONS[o] for o in opts).format(model_dir=os.environ.get("SHARDTUNE_TEST_MODEL_DIR"),
                                                          untied_dir=os.environ.get("SHARDTUNE_TEST_UNTIED_DIR"),
                                                          nvme_dir=nvme_dir)
        # zero2 and zero3 write OUTPUT_DIR/report as `train` does by default (tests/dist/test_report.py reads
        # them); the other variants skip its ~2 s of plotting.
        report = variant in ("zero2", "zero3")
        overrides = [f"parallel.strategy={strategy}", f"train.grad_accum={accum}", f"log.report={report}",
                     # zero3 also traces steps 2-3 with torch.profiler and logs to TensorBoard, Weights & Biases
                     # (offline) and MLflow (a file store) (tests/dist/test_monitors.py)
                     *(["log.profile={start: 2, steps: 2}", "log.tensorboard=true",
                        "log.wandb={project: shardtune-tests, mode: offline}",
                        f"log.mlflow={{experiment: shardtune-tests, tracking_uri: 'file://{out / 'mlruns'}'}}"]
                       if variant == "zero3" else []),
                     f"train.output_dir={out / variant.replace(':', '_')}", *extra.split()]
        if "compile" in opts:
            torch._dynamo.reset()  # this variant's graphs compiled anew, not served from an earlier variant's
        probe, graphs = Probe(), compiled_graphs()
        PROBES.clear()
        try:
            with compile_backend("aot_eager" if "aot" in opts else None), offload_all("actoff" in opts) as offloads, \
                    fused_loss_stand_in("fused" in opts) as fused_calls:
                result = run_training(config_from_dict(BASE, overrides), ctx)
        finally:
            probe.close()
        # What each rank's load read (rank order): a collective, so every rank joins for every variant.
        loads: list[dict[str, object]] = [{}] * ctx.world
        dist.all_gather_object(loads, PROBES[0].facts())
        summary, backend = result.summary, result.backend
        engine = getattr(backend, "engine", None)
        results[variant] = {"losses": summary["losses"], "grad_norms": summary["grad_norms"], **probe.facts(),
                            "compiled_graphs": compiled_graphs() - graphs, "nf4_params": nf4_params(backend.module),
                            "optimizer_state_types": optimizer_state_types(backend.optimizer),
                            "ds_stage": engine.zero_optimization_stage() if engine is not None else None,
                            "sharding": sharding_report(backend.module),
                            "world": ctx.world, "ds_fraction": deepspeed_partition_fraction(backend.module),
                            "dtypes": param_dtypes(backend.module), "comm": summary["comm"],
                            "numel": model_numel(backend.module), "logged": logged_fields(summary["output_dir"]),
                            "output_dir": summary["output_dir"], "load": loads,
                            "offloaded_bytes": sum(o.moved_bytes for o in offloads), "fused_calls": fused_calls}
        if summary.get("adapter_dir") and ctx.is_main:  # the file exists on rank 0 once save_adapter returns
            from safetensors.torch import load_file

            adapter = load_file(Path(summary["adapter_dir"]) / "adapter_model.safetensors")
            results[variant]["adapter_tensors"] = len(adapter)
            results[variant]["adapter_nonzero_b"] = sum(int(t.abs().sum() > 0) for k, t in adapter.items()
                                                        if "lora_B" in k)
        if "qlora" in opts:
            pass
        elif summary.get("adapter_dir"):
            results[variant]["base_weights_diff"] = base_weights_diff(backend)
            results[variant]["adapter_logit_diff"] = adapter_logit_diff(backend, summary["adapter_dir"], ctx.rank)
        else:
            results[variant]["export_logit_diff"] = export_logit_diff(backend, summary["model_dir"], ctx.rank)
        results[variant]["seconds"] = round(time.perf_counter() - started, 1)  # where a launch's time goes
    if ctx.is_main:
        (out / "results.json").write_text(json.dumps(results, indent=2))
    clean_exit(0)


if __name__ == "__main__":
    main()
