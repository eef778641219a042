"""One way to run a config: the knobs the planner varies and the facts of the machines."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.plan.shape import ModelShape

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# parallel.activation_memory_budget: the share of full checkpointing's recompute time a budget still pays, read
# between these points. Compile's partitioner keeps the bytes that are dearest to recompute (the matmuls'
# outputs) first, so it pays less than 1 - budget: 8B LoRA float8 at micro-batch 2 on one H100 (calls 89, 91:
# tokens/s between full checkpointing's and none's) paid 0.965 / 0.53 / 0.36 at 0.1 / 0.3 / 0.5, 8B LoRA bf16
# (call 94) 0.54 at 0.3, and the 1B full fine-tune (call 93) fell 5.1% at 0.5 where 1 - budget priced 9.7%.
BUDGET_RECOMPUTE = ((0.0, 1.0), (0.1, 0.965), (0.3, 0.535), (0.5, 0.36), (1.0, 0.0))


def piecewise(points: tuple[tuple[float, float], ...], x: float) -> float:
    """`points` ((x, y) pairs, x rising) read at x, linear between them and flat past the ends."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (max(x, x0) - x0) / (x1 - x0)
    return points[-1][1]


@dataclass(frozen=True)
class Setting:
    """The run as the memory and time models see it. `world` counts every process of the job;
    `per_node` those on one node (one GPU each)."""

    backend: str = "fsdp2"
    strategy: str = "zero3"
    offload: str = "none"  # none | optimizer | params
    nvme: bool = False
    activation_checkpointing: str = "none"  # none | selective | full
    checkpoint_blocks: int | None = None  # parallel.checkpoint_blocks: full checkpointing of the first N blocks only
    activation_offload: bool = False  # parallel.activation_offload: the decoder's saved tensors on the host
    tiled_mlp: int | None = None  # parallel.tiled_mlp: tokens per tile of each block's MLP
    checkpoint_in_compile: bool | str = "auto"  # parallel.checkpoint_in_compile as configured (checkpoint_traced)
    memory_budget: float | None = None  # parallel.activation_memory_budget (budget_recompute: its share here)
    shard_frozen: bool = True  # parallel.shard_frozen, resolved (auto: false on one process)
    one_gpu: str = "fsdp2"  # parallel.one_gpu as configured (one_gpu_direct: whether it applies here)
    compile: bool = False
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    precision: str = "bf16"
    peft: str = "none"  # none | lora | qlora
    base_dtype: str = "auto"
    dora: bool = False  # peft.use_dora
    optim: str = "adamw"
    compiled_update: bool = False  # optim.fused: compiled, or auto where it takes it (compiled_update_runs: applies)
    offload_embedding: bool = True  # peft.offload_embedding true or auto (embedding_on_host: whether it applies)
    offload_head: bool = False  # peft.offload_head (head_on_host: whether it applies)
    attn: str = "sdpa"
    packing: bool = False
    async_checkpoint: bool = False
    fused_loss: bool = False  # model.liger puts Liger's fused linear + cross-entropy in (every backend)
    liger_kernels: bool = False  # model.liger swaps Liger's RMSNorm, RoPE and SwiGLU into the blocks
    liger_chunk: int = 0  # model.liger_chunk: tokens per chunk of the fused loss (0 = Liger's own choice)
    liger_accum: str = "weight"  # model.liger_accum: what the fused loss sums the LM head's gradient in
    float8: str = "false"  # train.float8: false | tensorwise | rowwise
    world: int = 1
    per_node: int = 1
    shard_size: int | None = None  # hsdp's group; None = per_node

    @property
    def nnodes(self) -> int:
        return max(1, self.world // max(1, self.per_node))

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element (the compute precision)."""
        return PRECISION_BYTES[self.precision]

    @property
    def frozen_bytes(self) -> int:
        """Bytes of one frozen base weight under LoRA (peft.base_dtype, auto = the compute precision; float8: as
        loaded, before the adapted layers' casts, and the rest of the base)."""
        return PRECISION_BYTES[self.precision if self.base_dtype in ("auto", "float8") else self.base_dtype]

    @property
    def base_float8(self) -> bool:
        """LoRA's frozen float8 layers kept as their casts (peft.keeps_float8_base's rule: float8, or auto where
        the base is whole on each GPU)."""
        if self.base_dtype == "float8":
            return True
        return (self.base_dtype == "auto" and self.peft == "lora" and not self.dora and self.float8 == "tensorwise"
                and self.frozen_local)

    @property
    def mlp_tiled(self) -> bool:
        """parallel.tiled_mlp splits this micro-batch's MLP into tiles (more tokens than one tile)."""
        return self.tiled_mlp is not None and self.tokens > self.tiled_mlp

    @property
    def checkpoint_traced(self) -> bool:
        """Compile traces each block's checkpoint: the recompute inside the compiled backward
        (parallel.traces_checkpoint, the rule the run follows)."""
        from shardtune.parallel import long_sequence, traces_checkpoint

        return traces_checkpoint(self.compile, self.activation_checkpointing, self.checkpoint_in_compile,
                                 long_sequence(self))

    @property
    def recompute_compiled(self) -> bool:
        """The recompute, if any, runs inside the compiled backward: the traced checkpoint's, or a memory budget's."""
        return self.checkpoint_traced or self.budget_recompute > 0

    @property
    def budget_recompute(self) -> float:
        """The share of full checkpointing's recompute that parallel.activation_memory_budget leaves to compile's
        partitioner, inside the compiled backward: BUDGET_RECOMPUTE (measured) with compiled blocks and no
        checkpointing, else 0; its saved activations at the shares in plan/memory.py BUDGET_KEPT."""
        return piecewise(BUDGET_RECOMPUTE, self.memory_budget) if self.budget_applies else 0.0

    @property
    def budget_applies(self) -> bool:
        """parallel.activation_memory_budget is set and runs here: compiled blocks, no checkpointing."""
        return self.memory_budget is not None and self.compile and self.activation_checkpointing == "none"

    def recompute_share(self, layers: int) -> float:
        """The share of the `layers` blocks' forward that backward runs again: all of it under full checkpointing
        (the first parallel.checkpoint_blocks blocks' where set), budget_recompute under a memory budget, else none
        (selective checkpointing counts its own)."""
        if self.activation_checkpointing == "full":
            return self.checkpointed_layers(layers) / layers
        return self.budget_recompute

    def checkpointed_layers(self, layers: int) -> int:
        """Blocks checkpointing takes: parallel.checkpoint_blocks of the `layers` (full checkpointing), else all
        (none without checkpointing)."""
        if self.activation_checkpointing == "none":
            return 0
        return layers if self.checkpoint_blocks is None else min(self.checkpoint_blocks, layers)

    def blocks_left_out(self, layers: int) -> bool:
        """Whether full checkpointing leaves some of the `layers` blocks out (parallel.checkpoint_blocks under L)."""
        return self.activation_checkpointing == "full" and self.checkpointed_layers(layers) < layers

    @property
    def rules(self) -> Any:
        """The planner's model of this setting's backend (plan/backends.py)."""
        from shardtune.plan.backends import RULES

        return RULES[self.backend]

    @property
    def frozen_local(self) -> bool:
        """parallel.shard_frozen: false where it applies: the backend can keep a PEFT base stored in the compute
        dtype whole on every GPU (FSDP2's ignored_params; another dtype stays with FSDP2 for its cast)."""
        return (not self.shard_frozen and self.peft != "none" and self.rules.keeps_frozen_local(self)
                and self.frozen_bytes == self.compute_bytes)

    @property
    def one_gpu_direct(self) -> bool:
        """zero2 / zero3 run without FSDP2 here (parallel.one_gpu, as parallel.fsdp2.direct_applies decides)."""
        from shardtune.parallel.fsdp2 import direct_applies

        return self.rules.has_one_gpu_direct and direct_applies(
            self.one_gpu, world=self.world, strategy=self.strategy, peft=self.peft, precision=self.precision,
            optim=self.optim, activation_offload=self.activation_offload, base_dtype=self.base_dtype)

    @property
    def compiled_update_runs(self) -> bool:
        """The direct path's compiled update runs (optim.fused: compiled; parallel/compiled_adamw.py)."""
        return self.compiled_update and self.optim == "adamw" and self.one_gpu_direct

    @property
    def embedding_offloaded(self) -> bool:
        """peft.offload_embedding (true or auto) runs here: PEFT on the one-GPU direct path (embedding_on_host checks
        the model's embedding too)."""
        return self.offload_embedding and self.peft != "none" and self.one_gpu_direct

    def embedding_on_host(self, m: ModelShape) -> bool:
        """The frozen input embedding is kept on the host (embedding_offloaded, an embedding not tied to the LM
        head)."""
        return self.embedding_offloaded and m.head_params > 0

    @property
    def head_offloaded(self) -> bool:
        """peft.offload_head runs here: PEFT on the one-GPU direct path (head_on_host checks the model's head)."""
        return self.offload_head and self.peft != "none" and self.one_gpu_direct

    def head_on_host(self, m: ModelShape) -> bool:
        """The frozen LM head lives on the host between forwards (head_offloaded, a head of its own)."""
        return self.head_offloaded and m.head_params > 0

    @property
    def bf16_gradients_updated(self) -> bool:
        """The compiled update reads full fine-tuning's bf16 / fp16 gradients as autograd made them (one
        micro-batch a step): no fp32 gradient copy, and no cast of each gradient in backward."""
        return self.compiled_update_runs and self.grad_accum == 1 and self.peft == "none" and self.compute_bytes < 4

    @property
    def gradient_bytes(self) -> int:
        """Bytes each trainable parameter's gradient holds until the update: fp32, except under the compiled update
        with one micro-batch a step, which reads full fine-tuning's compute-dtype gradients as autograd made them
        (LoRA's matrices, cast in their forward, get fp32 gradients either way)."""
        if self.bf16_gradients_updated:
            return self.compute_bytes
        return 4

    @property
    def head_weight_bytes(self) -> int:
        """Bytes per LM head weight as Liger's fused loss reads it: the compute dtype; DDP's fp32 parameters under
        autocast."""
        return 4 if self.strategy == "ddp" else self.compute_bytes

    @property
    def head_accum_bytes(self) -> int:
        """Bytes per LM head weight of the gradient Liger's fused loss sums over its chunks (model.liger_accum):
        fp32, or the weight's dtype."""
        return 4 if self.liger_accum == "fp32" else self.head_weight_bytes

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch of one process."""
        return self.micro_batch_size * self.seq_len

    def param_shards(self) -> int:
        """Processes that share one copy of the parameters (1: each holds them whole)."""
        return self.rules.param_shards(self)

    def optim_shards(self) -> int:
        """Processes that share one copy of the optimizer states and fp32 masters."""
        return self.rules.optim_shards(self)

    def replace(self, **changes: Any) -> Setting:
        return dataclasses.replace(self, **changes)

    def knobs(self) -> dict[str, Any]:
        """The searched knobs, for tables and JSON."""
        return {"backend": self.backend, "strategy": self.strategy, "offload": self.offload,
                "activation_checkpointing": self.activation_checkpointing,
                "memory_budget": self.memory_budget if self.budget_applies else None,  # as its config says it
                "activation_offload": self.activation_offload, "shard_frozen": self.shard_frozen,
                "offload_embedding": self.embedding_offloaded, "offload_head": self.head_offloaded,
                "micro_batch_size": self.micro_batch_size,
                "checkpoint_in_compile": self.checkpoint_in_compile,
                "checkpoint_blocks": self.checkpoint_blocks if self.activation_checkpointing == "full" else None,
                "tiled_mlp": self.tiled_mlp}


def host_embedding_asked(value: bool | str) -> bool:
    """peft.offload_embedding as the planner reads it: true and auto ask for the host (Setting.embedding_on_host
    says where that applies), false keeps the table on the GPU."""
    return value is not False


def setting_from_config(cfg: Any, world: int, per_node: int, *, liger: bool = False) -> Setting:
    """The Setting a Config describes; `auto` strategy / micro-batch take placeholders the search replaces.
    `liger`: whether model.liger applies to this run on the hardware planned for (plan.liger_applies); its
    kernels go in as models.liger_rules.liger_kernels_wanted says."""
    from shardtune.models.liger_rules import chunk_tokens, head_adapted, liger_kernels_wanted
    from shardtune.parallel.fsdp2 import frozen_whole, takes_compiled_update

    p, t = cfg.parallel, cfg.train
    return Setting(
        backend=p.backend, strategy=p.strategy if p.strategy != "auto" else "zero3", offload=p.offload,
        nvme=p.offload_nvme_path is not None, activation_checkpointing=p.activation_checkpointing,
        checkpoint_blocks=p.checkpoint_blocks,
        activation_offload=p.activation_offload, tiled_mlp=p.tiled_mlp, checkpoint_in_compile=p.checkpoint_in_compile,
        memory_budget=p.activation_memory_budget,
        shard_frozen=not frozen_whole(p, world),
        one_gpu=p.one_gpu,
        compile=p.compile, micro_batch_size=t.micro_batch_size if t.micro_batch_size != "auto" else 1,
        grad_accum=t.grad_accum, seq_len=t.seq_len, precision=t.precision, peft=cfg.peft.method,
        base_dtype=cfg.peft.base_dtype, dora=cfg.peft.use_dora, optim=cfg.optim.name,
        compiled_update=takes_compiled_update(cfg), offload_embedding=host_embedding_asked(cfg.peft.offload_embedding),
        offload_head=cfg.peft.offload_head is True,  # auto: off unless the search takes it
        attn=cfg.model.attn_implementation,
        packing=cfg.data.packing, async_checkpoint=cfg.checkpoint.async_save,
        fused_loss=liger and not head_adapted(cfg.peft.method, cfg.peft.target_modules),
        liger_kernels=liger and liger_kernels_wanted(cfg.model.liger, p.compile),
        liger_chunk=chunk_tokens(cfg.model.liger_chunk), liger_accum=cfg.model.liger_accum,
        float8=str(t.float8 or "false"), world=world,
        per_node=per_node,
        shard_size=p.shard_size if isinstance(p.shard_size, int) else None)
