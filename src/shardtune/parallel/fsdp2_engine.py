"""The FSDP2 backend object a run drives (parallel/fsdp2.py holds what it runs and refuses, and what each
strategy shards).

Order (torchtitan's parallelize_llama): activation checkpointing -> compile each block ->
fully_shard each decoder block -> fully_shard the root -> materialise and load each rank's shard.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardtune.config import ParallelConfig
from shardtune.dist import DistContext, HostCopy
from shardtune.fileio import jsonable
from shardtune.models.attention import attn_implementation, model_inputs
from shardtune.models.weights import WeightSource, load_weights
from shardtune.parallel.base import DTYPES, LossFn, OptimizerFactory
from shardtune.parallel.fsdp2 import frozen_whole, hsdp_shard_size, uses_sharded_scaler
from shardtune.parallel.prepare import ActivationOffload, checkpoint_and_compile
from shardtune.peft.qlora import is_nf4

if TYPE_CHECKING:
    from shardtune.data import Batch

# Frozen parameters (a LoRA base) are re-read from the base model, never written to checkpoints.
_STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Not strict about the frozen ones left out; DCP's load already failed if a saved key was missing.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _without_frozen_aliases(module: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """`ignore_frozen_params` drops a frozen parameter under its first name only: a tied LM head
    (`lm_head.weight`, the frozen embedding under a second name) stayed in every LoRA checkpoint (the
    whole embedding matrix: ~1 GB at Llama-3-8B's vocabulary) and in adapters exported from it. Drop
    every name of a frozen parameter, as the DeepSpeed backend does. (Activation checkpointing and
    per-block compile keep parameter names, so the module's names are the state dict's keys.)"""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for key in frozen & set(model_sd):
        del model_sd[key]
    return model_sd


class FSDP2Backend:
    def __init__(self, parallel: ParallelConfig, precision: str, ctx: DistContext, loss: LossFn,
                 max_grad_norm: float) -> None:
        self.parallel, self.precision, self.ctx = parallel, precision, ctx
        self.loss, self.max_grad_norm = loss, max_grad_norm
        self.skip_nonfinite = True  # the loop sets train.skip_nonfinite
        self.step_skipped = False  # whether the last step() left the weights as they were (non-finite grads)
        # ... or, when set, the flag that says so, still on its way from the GPU (DirectBackend's update)
        self.skip_flag: HostCopy | None = None
        self.compute_dtype = DTYPES[precision]
        self.module: nn.Module = nn.Module()
        self.model: nn.Module = self.module
        self.scaler: torch.amp.GradScaler | None = None
        self.attn_implementation = "sdpa"  # the model's, read in setup (it picks the packed-batch mask)
        # The model's forward computes the summed loss itself when given labels (models/liger.py's fused linear +
        # cross-entropy): inside the root forward, so FSDP2 has gathered the LM head for it.
        self.fused_loss = False
        self.activation_offload: ActivationOffload | None = None  # parallel.activation_offload's hooks
        self.step_params: list[nn.Parameter] = []  # set up by setup()

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None,
              make_optimizer: OptimizerFactory) -> None:
        self.attn_implementation = attn_implementation(model)
        self.activation_offload = checkpoint_and_compile(model, blocks, self.parallel, self.ctx.device.type)
        self._place(model, blocks, weights)
        # What the optimizer updates, and each step clips (DirectBackend: the fp32 masters, not the model's copies).
        self.step_params = [self._trained(p) for p in self.module.parameters()]
        named = ((n, self._trained(p)) for n, p in self.module.named_parameters())
        self.optimizer = make_optimizer(named, self.ctx.device,
                                        sharded_fp16=uses_sharded_scaler(self.parallel, self.precision))
        if self.precision == "fp16":
            self.scaler = self._grad_scaler()

    def _place(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None) -> None:
        """Load the weights and wrap the model as the strategy runs it (DDP, or FSDP2 per block)."""
        if self.parallel.strategy == "ddp":
            self._setup_ddp(model, weights)
        else:
            self._setup_fsdp(model, blocks, weights)

    def _trained(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer holds for a model parameter (itself; DirectBackend: its fp32 master)."""
        return param

    def _setup_ddp(self, model: nn.Module, weights: WeightSource | None) -> None:
        load_weights(model, weights, self.ctx.device)
        self.module = model
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # Every rank loaded the same weights already; DDP's start-up broadcast would only cost time,
        # and it corrupts NF4 (QLoRA) parameters, whose data is not one flat tensor.
        self.model = DistributedDataParallel(model, device_ids=ids, init_sync=False)
        if self.ctx.world > 1:
            # The same all-reduce as DDP's built-in one (divide by the world, sum), issued through
            # torch.distributed's Python entry point, where the run's communication accounting counts it
            # (metrics/comm.py); DDP's own reducer calls the process group from C++, out of its sight.
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.model.register_comm_hook(None, allreduce_hook)

    def _setup_fsdp(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None) -> None:
        mesh = self._mesh()
        # Parameters stay fp32 (the optimizer's master copy); compute in the low precision and
        # reduce gradients in fp32 so the sum over ranks loses nothing.
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        reshard = self.parallel.strategy in ("zero3", "hsdp")
        # On a mesh of one there is nothing to shard, and torchao's NF4 all-gather fails there: FSDP2
        # leaves the NF4 weights alone (plain frozen parameters, moved to the device by load_weights)
        # and still does the mixed precision of the rest (no autocast: QLoRA's fast path on one GPU).
        ignored = {p for p in model.parameters() if is_nf4(p)} if self.ctx.world == 1 else set()
        if frozen_whole(self.parallel, self.ctx.world):  # whole on every GPU, used as they are: no gather, no copy
            ignored |= {p for p in model.parameters()
                        if not p.requires_grad and p.dtype == self.compute_dtype and not is_nf4(p)}
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them gathered.
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(blocks) - 1,
                        ignored_params=ignored or None)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None)
        not_sharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) and p not in ignored]
        if not_sharded:
            raise RuntimeError(f"fully_shard left {len(not_sharded)} parameters unsharded, e.g. {not_sharded[:3]}")
        load_weights(model, weights, self.ctx.device)
        self.module = self.model = model

    def _mesh(self) -> Any:
        """1-D over all processes; hsdp: (replicate, shard), so a model copy is sharded over shard_size
        processes (one node by default) and gradients are reduce-scattered inside the group and
        all-reduced across groups (FSDP2's HSDP)."""
        world = self.ctx.world
        if self.parallel.strategy != "hsdp":
            return init_device_mesh(self.ctx.device.type, (world,), mesh_dim_names=("fsdp",))
        shard = hsdp_shard_size(self.parallel, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        return init_device_mesh(self.ctx.device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    def _grad_scaler(self) -> torch.amp.GradScaler:
        if not uses_sharded_scaler(self.parallel, self.precision):
            return torch.amp.GradScaler(self.ctx.device.type)
        # Each rank sees only its gradient shard: the sharded scaler agrees on inf/NaN across ranks.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.ctx.device.type)

    # ---- the step -------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.parallel.strategy == "ddp" and self.precision != "fp32":
            return torch.autocast(self.ctx.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()  # FSDP2 casts through its MixedPrecisionPolicy

    def forward(self, batch: Batch) -> torch.Tensor:
        # Unpacked rows are right-padded and padding carries no loss, so causal attention alone is exact
        # for every loss-carrying position: input_ids only keeps SDPA on its fast causal kernel. Packed
        # rows get position_ids and a document-causal mask, built once here, outside the blocks.
        inputs = self._inputs(batch)
        with self._autocast():
            out = self.model(**inputs, use_cache=False)
        return out.logits

    def _inputs(self, batch: Batch) -> dict[str, Any]:
        return model_inputs(batch, self.attn_implementation, dtype=self.compute_dtype)

    def _fused_loss(self, batch: Batch) -> torch.Tensor:
        inputs = self._inputs(batch)
        with self._autocast():
            return self.model(**inputs, labels=batch.labels, use_cache=False).loss

    def forward_backward(self, batch: Batch, normalizer: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        no_sync = self.parallel.strategy == "ddp" and not sync_grads
        with self.model.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
            loss = (self._fused_loss(batch) if self.fused_loss else self.loss(self.forward(batch), batch.labels))
            loss = loss / normalizer
            # DDP and FSDP2 average gradients over ranks; the loss is already normalised by the
            # step's global token count, so undo the average to get the gradient of that loss.
            scaled = loss * self.ctx.world
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def step(self) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = self.step_params
        norm = total_grad_norm(params)
        # The norm is global, so every rank takes the same decision. fp16's scaler skips overflows itself (and
        # they are routine while it finds its scale); other precisions would write NaN into every weight. The
        # flag is copied before the clip (or the update) is queued and read after, so the GPU stays busy while
        # the host waits for the norm and then queues the update (the clip of a skipped step is wasted).
        bad = (~torch.isfinite(norm)).float()
        return self._update(norm, bad, HostCopy(bad))

    def _update(self, norm: torch.Tensor, bad: torch.Tensor, flag: HostCopy) -> torch.Tensor:
        """Clip, skip a non-finite step (the flag read here: fp16's scaler skips overflows itself), update."""
        params = self.step_params
        if self.max_grad_norm > 0 and any(p.grad is not None for p in params):
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        self.skip_flag = None
        self.step_skipped = self.scaler is None and self.skip_nonfinite and flag.values()[0] > 0
        if self.step_skipped:
            pass
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def step_applied(self) -> bool:
        return True  # the schedule steps with every step, as torch's does after a GradScaler skip

    # ---- checkpoint state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name (sharded DTensors under FSDP2), for DCP."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=_STATE_OPTIONS)
        return {"model": _without_frozen_aliases(self.module, model_sd), "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict takes each group's settings from the checkpoint, `fused` and `foreach` too: a run
        # resumed with another optim.fused would update as the saved one did (and the direct path's fused update
        # would hand its clip to a foreach AdamW, which refuses it). The kernel is this run's choice.
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_LOAD_OPTIONS)
        for group, kernel in zip(self.optimizer.param_groups, kernels, strict=True):
            group.update(kernel)

    def extra_state(self) -> dict[str, Any]:
        """The JSON-able rest: the loss scaler."""
        return {"scaler": jsonable(self.scaler.state_dict()) if self.scaler is not None else None}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def train(self, mode: bool = True) -> None:
        """Switch train/eval mode. Back in training, reshard what an eval forward left gathered
        (zero2 blocks and the root keep their parameters after a forward that has no backward)."""
        self.model.train(mode)
        if mode:
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """Collective for a sharded parameter: its whole tensor on every rank."""
        t = param.detach()
        return t.full_tensor() if isinstance(t, DTensor) else t


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 grad norm over all ranks (DTensor shards included)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sum of squares over the shards of every rank
    return total
