"""parallel.one_gpu: direct — zero2 / zero3 on one process without FSDP2 (fsdp2.runs_direct): the model computes
with compute-dtype copies of its trainable weights, the optimizer holds their fp32 masters. What only this path
runs lives here: the update with clipping and the non-finite skip inside fused AdamW's kernel, optim.fused:
compiled (compiled_adamw.py), peft.offload_embedding (host_embedding.py), peft.offload_head (host_head.py), and
LoRA's matrices cast in their forward (CastLinear)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardtune.config import ParallelConfig
from shardtune.dist import DistContext, HostCopy
from shardtune.models.weights import WeightSource, load_weights
from shardtune.parallel.base import LossFn, OptimizerFactory
from shardtune.parallel.compiled_adamw import CompiledAdamW
from shardtune.parallel.fsdp2_engine import FSDP2Backend
from shardtune.parallel.host_embedding import HostEmbedding, offload_embedding
from shardtune.parallel.host_head import HostHead, offload_head

if TYPE_CHECKING:
    from shardtune.data import Batch


class DirectBackend(FSDP2Backend):
    """FSDP2Backend's seams on one process without FSDP2 (the same arithmetic as FSDP2 on a mesh of one, without its
    copies through the all-gather and reduce-scatter buffers)."""

    def __init__(self, parallel: ParallelConfig, precision: str, ctx: DistContext, loss: LossFn,
                 max_grad_norm: float, *, compiled_update: bool = False,
                 offload_embedding: bool | str = False, offload_head: bool = False) -> None:
        super().__init__(parallel, precision, ctx, loss, max_grad_norm)
        # (owner module, attribute, compute-dtype parameter, fp32 master) per place a trainable weight sits (a
        # tied weight sits in two); the optimizer holds the masters
        self.places: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.masters: dict[int, nn.Parameter] = {}  # id(compute parameter) -> its master
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (compute parameter, master), each once
        self.update_in_kernel = False  # set up by setup()
        # optim.fused: compiled: norm, clip, skip, AdamW and the cast to the compute copies as compiled code; a
        # step's only micro-batch leaves its gradients in the compute dtype for it (grads_stay)
        self.wants_compiled_update = compiled_update
        self.compiled_update: CompiledAdamW | None = None
        self.micro_batches = 0  # micro-batches run since the last step
        self.grads_stay = False
        self.wants_host_embedding = offload_embedding  # peft.offload_embedding: true, "auto" or false
        self.host_embedding: HostEmbedding | None = None
        self.wants_host_head = offload_head  # peft.offload_head
        self.host_head: HostHead | None = None

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None,
              make_optimizer: OptimizerFactory) -> None:
        super().setup(model, blocks, weights, make_optimizer)
        # fused AdamW takes the clip and the non-finite skip into its kernel (decided once here, not every step)
        self.update_in_kernel = self.scaler is None and bool(self.optimizer.defaults.get("fused"))
        if self.wants_compiled_update and self.scaler is None:
            self.compiled_update = CompiledAdamW(self.optimizer, {id(m): c for c, m in self.pairs})

    def frozen_on_host(self) -> str:
        """The start line naming the frozen weights peft.offload_embedding / peft.offload_head keep on the host ("":
        none)."""
        holders = {"input embedding": self.host_embedding, "LM head": self.host_head}
        parts = [f"the {name} ({h.module.weight.nbytes / 2**20:,.1f} MiB)" for name, h in holders.items()
                 if h is not None]
        return f"host memory: {' and '.join(parts)} (peft.offload_embedding / offload_head)" if parts else ""

    def _trained(self, param: nn.Parameter) -> nn.Parameter:
        return self.masters.get(id(param), param)

    def _place(self, model: nn.Module, blocks: list[nn.Module], weights: WeightSource | None) -> None:
        """parallel.one_gpu: direct on one process: no FSDP2. Each trainable weight stays as its fp32 master (the
        optimizer's, the checkpoint's, the export's) and the model computes with a compute-dtype copy of it,
        refreshed once per step; gradients are cast into the masters' fp32 gradients once per micro-batch. On a
        mesh of one FSDP2 does the same arithmetic through its all-gather and reduce-scatter buffers (a profile
        of the 1B shape on one H200: ~24 ms of a 155 ms step in copies, bench/RESULTS.md 2026-12-04)."""
        load_weights(model, weights, self.ctx.device)
        self.module = self.model = model
        if self.wants_host_embedding:
            self.host_embedding = offload_embedding(model, self.ctx.device,
                                                    required=self.wants_host_embedding is True)
        if self.wants_host_head:
            self.host_head = offload_head(model, self.ctx.device)
        cast_adapters_in_forward(model, self.compute_dtype)
        seen: dict[int, nn.Parameter] = {}
        for owner in model.modules():
            for name, master in list(owner._parameters.items()):
                if master is None or not master.requires_grad or master.dtype == self.compute_dtype:
                    continue  # frozen, or already in the compute dtype (fp32 runs): used as it is
                if isinstance(owner, CastLinear):
                    continue  # an adapter's matrix: cast inside its forward
                if id(master) not in seen:
                    seen[id(master)] = nn.Parameter(master.detach().to(self.compute_dtype))
                    # Each gradient goes to its master as soon as backward has made it, and is freed: at most a
                    # few compute-dtype gradients are alive, as under FSDP2's per-block reduce-scatter.
                    seen[id(master)].register_post_accumulate_grad_hook(self._gradient_to_master)
                compute = seen[id(master)]
                owner._parameters[name] = compute
                self.places.append((owner, name, compute, master))
                self.masters[id(compute)] = master
        self.pairs = [(compute, self.masters[id(compute)]) for compute in seen.values()]

    @contextlib.contextmanager
    def _masters_in_place(self) -> Any:
        """The fp32 masters in the model's attributes for a while (state dicts see what the optimizer holds)."""
        for owner, name, _, master in self.places:
            owner._parameters[name] = master
        try:
            yield
        finally:
            for owner, name, compute, _ in self.places:
                owner._parameters[name] = compute

    def _gradient_to_master(self, compute: torch.Tensor) -> None:
        """A compute-dtype gradient into its master's fp32 one (summed over micro-batches in fp32, as FSDP2's
        reduce_dtype does), then freed; under the compiled update a step's only micro-batch leaves it where it
        is (the update reads it in the compute dtype)."""
        master = self.masters[id(compute)]
        if self.grads_stay and master.grad is None:
            return
        if master.grad is None:
            master.grad = compute.grad.to(torch.float32)
        else:
            master.grad.add_(compute.grad)
        compute.grad = None

    @torch.no_grad()
    def _masters_to_compute(self) -> None:
        if self.pairs:
            torch._foreach_copy_([c for c, _ in self.pairs], [m for _, m in self.pairs])  # the one cast per step

    # ---- the step -------------------------------------------------------------------------
    def _inputs(self, batch: Batch) -> dict[str, Any]:
        if self.host_embedding is not None:  # the lookup on the host reads the batch's host copy of the ids
            self.host_embedding.ids = batch.host_input_ids
        return super()._inputs(batch)

    def forward_backward(self, batch: Batch, normalizer: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        # sync_grads: the step's last micro-batch; also its first, so its only one
        self.grads_stay = self.compiled_update is not None and sync_grads and self.micro_batches == 0
        self.micro_batches += 1
        return super().forward_backward(batch, normalizer, sync_grads=sync_grads)

    def step(self) -> torch.Tensor:
        self.micro_batches = 0
        if self.compiled_update is not None:
            return self._update_compiled()
        return super().step()

    def _update(self, norm: torch.Tensor, bad: torch.Tensor, flag: HostCopy) -> torch.Tensor:
        if self.update_in_kernel:
            return self._update_in_fused_adamw(norm, bad, flag)
        norm = super()._update(norm, bad, flag)
        if not self.step_skipped:
            self._masters_to_compute()
        return norm

    def _update_in_fused_adamw(self, norm: torch.Tensor, bad: torch.Tensor, flag: HostCopy) -> torch.Tensor:
        """parallel.one_gpu: direct with fused AdamW: the clipping and the non-finite skip go into the optimizer's
        kernel, through the `grad_scale` / `found_inf` it takes from GradScaler (it divides every gradient by
        grad_scale, and leaves every weight and moment as they were when found_inf is 1). No multiply over the
        gradients, and no wait at all: the skip flag goes to pinned memory and the loop reads it once the next
        step's kernels are queued (a skipped step's cast into the compute copies rewrites what they held). The
        same update as clipping first, to rounding. (Plain tensors only: a DTensor's shape-[1] flag fails the
        fused kernel, see train.optim.use_fused.)"""
        if self.max_grad_norm > 0:  # clip_grads_with_norm_'s factor, as a divisor
            self.optimizer.grad_scale = (norm + 1e-6).div(self.max_grad_norm).clamp(min=1.0)
        if self.skip_nonfinite:
            self.optimizer.found_inf = bad
        try:
            self.optimizer.step()
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
            self.optimizer.__dict__.pop("found_inf", None)
        self.optimizer.zero_grad(set_to_none=True)
        self._masters_to_compute()
        # Not read here: reading waits for the GPU to finish the backward. The loop reads it once the next
        # step's kernels are queued (train/loop.py, _Pending).
        self.step_skipped = False
        self.skip_flag = flag if self.skip_nonfinite else None
        return norm

    def _update_compiled(self) -> torch.Tensor:
        """optim.fused: compiled: the whole update queued as compiled code (compiled_adamw); the skip flag, as in
        _update_in_fused_adamw, goes to pinned memory and is read once the next step's kernels are queued."""
        norm = self.compiled_update.step(self.max_grad_norm, self.skip_nonfinite)
        self.compiled_update.zero_grad()
        self.step_skipped = False
        if norm is None:  # no gradient anywhere (nothing trainable took part): as optimizer.step() would
            self.skip_flag = None
            return torch.zeros((), device=self.ctx.device)
        self.skip_flag = HostCopy((~torch.isfinite(norm)).float()) if self.skip_nonfinite else None
        return norm

    # ---- checkpoint state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._masters_in_place():
            return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._masters_in_place():
            super().load_state_dict(state)
        self._masters_to_compute()

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return self.masters.get(id(param), param).detach()  # the fp32 master is what is exported


class CastLinear(nn.Linear):
    """A LoRA adapter's A or B matrix under parallel.one_gpu: direct: its fp32 weight (the optimizer's master) is
    cast to the compute dtype inside the forward, as FSDP2's mixed precision casts each block's parameters when it
    runs, and autograd casts the gradient back into the master's fp32 `.grad`. No compute-dtype copy of the
    adapters is kept through the step (8B LoRA r=16 on all projections: 84 MB, which put the direct path 0.08 GiB
    over FSDP2's peak on one H200, bench/RESULTS.md call 48); under activation checkpointing the recompute casts
    again. The same arithmetic as the copy: the compute-dtype weight, input and output, and an fp32 gradient."""

    compute_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


def cast_adapters_in_forward(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every plain LoRA layer's A and B matrices CastLinear (the class swapped in place: names, parameters
    and state dicts unchanged), and stop PEFT casting the layer's input to their fp32 (it would be cast back).
    DoRA and other variants read the matrices outside their forward: they keep the compute-dtype copy. Returns
    how many matrices now cast in their forward."""
    count = 0
    for layer in model.modules():
        adapters_a, adapters_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
        if not isinstance(adapters_a, nn.ModuleDict) or not isinstance(adapters_b, nn.ModuleDict):
            continue
        if getattr(layer, "lora_variant", None) or any(getattr(layer, "use_dora", {}).values()):
            continue
        matrices = [m for m in (*adapters_a.values(), *adapters_b.values()) if type(m) is nn.Linear]
        if len(matrices) != len(adapters_a) + len(adapters_b):
            continue
        layer.cast_input_dtype_enabled = False
        for m in matrices:
            m.__class__ = CastLinear
            m.compute_dtype = dtype
        count += len(matrices)
    return count
