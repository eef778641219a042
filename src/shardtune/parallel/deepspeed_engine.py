"""The DeepSpeed backend object a run drives (parallel/deepspeed.py holds what it runs and refuses, and which
ZeRO stage each strategy is).

The loop's conventions are kept: the loss handed to backward is already normalised by the step's
global target-token count, so the engine's own averaging (over ranks, and over accumulation steps)
is undone; the LR schedule is shardtune's own (stepped here, saved in trainer_state.json) so both
backends follow one schedule; clipping, loss scaling and accumulation run inside the engine.

Weights: ZeRO-0/1/2 hold full replicas, loaded like DDP. ZeRO-3 is materialised one decoder block at
a time: the block gets storage, its tensors are read, and `zero.Init(module=block)` partitions it at
once (DeepSpeed broadcasts rank 0's values while partitioning), so a process never holds more
than one block plus the embeddings in full.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardtune.config import ParallelConfig
from shardtune.dist import DistContext
from shardtune.models.attention import attn_implementation, model_inputs
from shardtune.models.build import assert_no_meta, restore_buffers
from shardtune.models.weights import WeightSource, load_weights, retie, shared_parameters
from shardtune.parallel.base import DTYPES, LossFn, OptimizerFactory
from shardtune.parallel.ds_config import STAGES
from shardtune.parallel.prepare import checkpoint_and_compile

if TYPE_CHECKING:
    from shardtune.data import Batch


class DeepSpeedBackend:
    def __init__(self, parallel: ParallelConfig, precision: str, ctx: DistContext, ds_config: dict[str, Any],
                 loss: LossFn) -> None:
        self.parallel, self.precision, self.ctx, self.ds_config = parallel, precision, ctx, ds_config
        self.loss = loss
        self.stage = STAGES[parallel.strategy]
        self.compute_dtype = DTYPES[precision]
        self.module: nn.Module = nn.Module()
        self.engine: Any = None
        self.attn_implementation = "sdpa"
        self.skip_nonfinite = True  # the loop sets train.skip_nonfinite (validate refuses false above stage 0)
        self._skipped_here = False  # the last step()'s update was skipped by this backend (stage 0)
        # The model's forward computes the summed loss itself when given labels (models/liger.py's fused linear +
        # cross-entropy, set by the loop where model.liger takes it; under ZeRO-3 see _gather_head_for_the_loss).
        self.fused_loss = False

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None,
              make_optimizer: OptimizerFactory) -> None:
        import deepspeed

        _init_comm()
        self.attn_implementation = attn_implementation(model)
        checkpoint_and_compile(model, blocks, self.parallel, self.ctx.device.type)  # compile: zero0-2 (validate)
        if self.stage == 3:
            self._materialise_partitioned(model, blocks, weights)
            self._gather_head_for_the_loss(model)
            if self.parallel.tiled_mlp is not None:
                self._gather_each_mlp_once(blocks)
        else:
            load_weights(model, weights, self.ctx.device)
        self.module = model
        # The client optimizer: the loop's schedule drives its param groups, which the ZeRO optimizer steps.
        # Offloaded states are stepped on the host.
        self.optimizer = make_optimizer(model.named_parameters(), self.ctx.device,
                                        on_host=self.parallel.offload != "none")
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config,
                                                    dist_init_required=False)

    def _materialise_partitioned(self, model: nn.Module, blocks: list[nn.Module],
                                 weights: WeightSource | None) -> None:
        """ZeRO-3: give each decoder block storage, fill it, partition it; then the rest of the model."""
        import deepspeed

        names = {module: name for name, module in model.named_modules()}
        shared = shared_parameters(model)
        in_blocks = {id(m) for block in blocks for m in block.modules()}
        for block in blocks:
            block.to_empty(device=self.ctx.device)
            self._fill(block, names[block], weights)
            deepspeed.zero.Init(module=block, config_dict_or_path=self.ds_config)
        for module in model.modules():  # embeddings, final norm, LM head: what no block holds
            if id(module) not in in_blocks:
                module.to_empty(device=self.ctx.device, recurse=False)
        retie(model, shared)
        restore_buffers(model, self.ctx.device)
        filled: set[int] = set()  # a tied weight is read once, under its first name (as load_weights does)
        for module in model.modules():
            if id(module) not in in_blocks:
                self._fill(module, names[module], weights, recurse=False, skip=filled)
        deepspeed.zero.Init(module=model, config_dict_or_path=self.ds_config)  # skips what is partitioned
        assert_no_meta(model)

    @staticmethod
    def _gather_head_for_the_loss(model: nn.Module) -> None:
        """ZeRO-3 with the fused loss: the LM head's weight becomes an external parameter of the module that reads
        it (models/liger.py FusedLossHead), so DeepSpeed gathers it for the loss in forward and again in backward,
        where its gradient is accumulated (a partitioned parameter would take a whole gradient: a size mismatch)."""
        import deepspeed

        from shardtune.models.liger import FusedLossHead

        for module in model.modules():
            if isinstance(module, FusedLossHead):
                deepspeed.zero.register_external_parameter(module, module.weight)

    @staticmethod
    def _gather_each_mlp_once(blocks: list[nn.Module]) -> None:
        """ZeRO-3 with the MLPs in tiles: each MLP becomes a leaf for ZeRO-3 (`deepspeed.utils.set_z3_leaf_module`),
        so its weights are gathered once for all its tiles, as untiled. This matters in the first step only: until
        DeepSpeed has recorded its trace of the module order, each projection's own hooks release it after a tile
        and gather it again for the next (micro-llama, 3 tiles: 2.5x the bytes of the first step); from the second
        step on the trace keeps it gathered across tiles, leaf or not. A one-step long-sequence run is all first
        step."""
        from deepspeed.utils import set_z3_leaf_module

        for block in blocks:
            set_z3_leaf_module(block.mlp, True)

    @torch.no_grad()
    def _fill(self, module: nn.Module, prefix: str, weights: WeightSource | None, *, recurse: bool = True,
              skip: set[int] | None = None) -> None:
        skip = set() if skip is None else skip
        for name, param in module.named_parameters(recurse=recurse):
            if hasattr(param, "ds_id") or id(param) in skip:
                continue
            skip.add(id(param))
            if weights is not None:
                full = f"{prefix}.{name}" if prefix else name
                param.copy_(weights.rows(full, param.shape, 0, param.shape[0] if param.dim() else 0, param.dtype))
            if self.precision != "fp32":  # ZeRO-3 keeps the module's partitions in the compute dtype
                param.data = param.data.to(self.compute_dtype)

    # ---- the step -------------------------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.engine(**self._inputs(batch), use_cache=False).logits

    def _inputs(self, batch: Batch) -> dict[str, Any]:
        return model_inputs(batch, self.attn_implementation, dtype=self.compute_dtype)

    def _fused_loss(self, batch: Batch) -> torch.Tensor:
        return self.engine(**self._inputs(batch), labels=batch.labels, use_cache=False).loss

    def forward_backward(self, batch: Batch, normalizer: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        self.engine.set_gradient_accumulation_boundary(sync_grads)
        loss = self._fused_loss(batch) if self.fused_loss else self.loss(self.forward(batch), batch.labels)
        loss = loss / normalizer
        # The engine averages gradients over ranks; the loss is already normalised by the step's
        # global token count (and is not divided by the accumulation steps: scale_wrt_gas=False).
        self.engine.backward(loss * self.ctx.world, scale_wrt_gas=False)
        if not sync_grads:
            self.engine.step()  # inside an accumulation window: bookkeeping only, no update
        return loss.detach()

    def step(self) -> torch.Tensor:
        self._grad_norm_before_step = self._replica_grad_norm() if self.stage == 0 else 0.0
        # ZeRO stages 1-3 skip an update whose gradient norm is not finite themselves (fp32, and bf16 with
        # check_grad_overflow, DeepSpeed's default); stage 0 hands the gradients to the torch optimizer as they are.
        # Its gradients are replicas by now, so every rank decides alike. The engine still takes its step (its
        # counters, zeroing the gradients) with the optimizer's own step a no-op: weights and optimizer state stay
        # as they were, as FSDP2 leaves them.
        self._skipped_here = (self.stage == 0 and self.skip_nonfinite and self.precision != "fp16"
                              and not bool(torch.isfinite(torch.as_tensor(self._grad_norm_before_step))))
        optimizer = self.engine.optimizer
        if self._skipped_here:
            optimizer.step = lambda *args, **kwargs: None  # shadows the method for this one call
        try:
            self.engine.step()  # at the boundary: reduce, unscale, clip, optimizer step, zero grads
        finally:
            if self._skipped_here:
                del optimizer.step
        norm = self.engine.get_global_grad_norm()
        if norm is None:  # stage 0 in fp32 clips without keeping the norm: the reduced grads are replicas
            norm = self._grad_norm_before_step
        return torch.as_tensor(norm, dtype=torch.float32).detach()

    @property
    def step_skipped(self) -> bool:
        """The last step left the weights as they were because its gradients were not finite (counted by the loop,
        as FSDP2's). fp16's overflows are its loss scaler's routine, as under FSDP2: not counted."""
        return self.precision != "fp16" and (self._skipped_here or not self.engine.was_step_applied())

    @property
    def step_applied(self) -> bool:
        # An fp16 overflow holds the LR schedule; a skipped non-finite step advances it, as under FSDP2.
        return bool(self.engine.was_step_applied()) or self.step_skipped

    def _replica_grad_norm(self) -> torch.Tensor | float:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else 0.0

    # ---- checkpoint state (DeepSpeed's own sharded format) -------------------------------------
    def save_native(self, path: Path, tag: str) -> None:
        """Collective: model + optimizer state in DeepSpeed's layout under path/tag (one file per rank)."""
        frozen = not all(p.requires_grad for p in self.module.parameters())
        with _without_frozen_aliases(self.engine, frozen):
            self.engine.save_checkpoint(str(path), tag=tag, save_latest=False, exclude_frozen_parameters=frozen)

    def load_native(self, path: Path, tag: str) -> None:
        """Collective: restore from path/tag. The caller guards the reads (checkpoint.deepspeed_files:
        DeepSpeed unpickles its files freely)."""
        loaded, _ = self.engine.load_checkpoint(str(path), tag=tag, load_lr_scheduler_states=False,
                                                load_module_strict=all(p.requires_grad for p in
                                                                       self.module.parameters()))
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}")

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("the deepspeed backend writes DeepSpeed checkpoints (save_native)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the deepspeed backend reads DeepSpeed checkpoints (load_native)")

    def extra_state(self) -> dict[str, Any]:
        return {"scaler": None}  # the engine keeps its loss scaler in its own files

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ---- the rest of the seam --------------------------------------------------------------
    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """Collective under ZeRO-3: the whole tensor of a (partitioned) parameter."""
        if not hasattr(param, "ds_id"):
            return param.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone()


def _init_comm() -> None:
    """Join DeepSpeed's comm layer to the process group shardtune already made."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    if not torch.cuda.is_available():
        # On CPU, DeepSpeed compiles a shared-memory all-reduce op at start-up (~25-50 s on a fresh
        # machine) and probes every op builder with the compiler. Collectives here go through gloo, so
        # mark the op unavailable; DeepSpeed reads this dict only to decide on that op.
        compatible = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
        compatible["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


@contextlib.contextmanager
def _without_frozen_aliases(engine: Any, frozen: bool) -> Iterator[None]:
    """`exclude_frozen_parameters` drops frozen parameters by their first name only: a tied LM head
    (`lm_head.weight`, the frozen embedding under a second name) stayed in every LoRA checkpoint of
    stages 0-2 (0.5 GB for a 1B model). Drop every name of a frozen parameter from the module state."""
    if not frozen:
        yield
        return
    names = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    original = engine.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        state = original(*args, **kwargs)  # a fresh state dict: trimmed in place, keeping its metadata
        for key in names & set(state or ()):
            del state[key]
        return state

    engine.module_state_dict = module_state_dict  # DeepSpeed's save path calls self.module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict
