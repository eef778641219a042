"""`train.float8`: torchao's float8 training for the Linear layers of the transformer blocks.

Each converted layer (torchao.float8.Float8Linear, a subclass of nn.Linear with the same parameters and state
dict keys, so checkpoints and exports do not change) casts its input, weight and output gradient to float8 with
dynamic scales and runs its three matmuls through `torch._scaled_mm`: `tensorwise` one scale per tensor (the
fastest), `rowwise` one per row (closer to bf16). The LM head and the embeddings stay bf16 (torchtitan's choice:
the head's logits feed the loss directly). The conversion happens on the meta model, before sharding and
compile, as torchtitan does; torch.compile fuses the casts into the neighbouring kernels.

With LoRA only the frozen base layers (PEFT's `base_layer`) convert: the adapters' small matrices stay bf16 and
train as before, and the base's matmuls (forward, recompute, the input's gradient) run in float8; the weight's
gradient torchao's backward also forms is dead code for a frozen weight, which torch.compile drops. QLoRA's base is
NF4 already: refused. Needs bf16, the FSDP2 / DDP backend, and on GPUs compute capability 8.9+ (H100, H200, L40S,
RTX 4090). It runs on CPUs too (torch's `_scaled_mm`), which is how it is tested; speed: bench/RESULTS.md."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from shardtune.errors import ShardtuneError

EXCLUDED = ("lm_head", "embed_tokens")  # kept in the compute dtype


def check_float8(cfg: Any, device_type: str) -> None:
    """Refuse `train.float8` where it cannot run, in one line with the fix (the backends refuse it themselves
    where they do not run it: parallel/deepspeed.py)."""
    recipe = cfg.train.float8
    if not recipe:
        return
    key = f"train.float8: {recipe}"
    if cfg.train.precision != "bf16":
        raise ShardtuneError(f"{key} trains in float8 from bf16 weights; set train.precision=bf16")
    if cfg.peft.method == "qlora":
        raise ShardtuneError(f"{key}: QLoRA's base layers are NF4 already (peft.method=qlora); set "
                             "train.float8=false, or peft.method=lora for a float8 base")
    tokens = cfg.train.micro_batch_size
    if isinstance(tokens, int) and tokens * cfg.train.seq_len % 16:
        raise ShardtuneError(f"{key}: float8 matmuls need the tokens of a micro-batch (micro_batch_size x seq_len "
                             f"= {tokens * cfg.train.seq_len}) to be a multiple of 16; change train.seq_len")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ShardtuneError(f"{key} needs torchao; pip install 'torchao>=0.16' (or pip install -e '.[qlora]')") \
            from None
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ShardtuneError(f"{key} needs a GPU of compute capability 8.9 or newer (H100, H200, L40S, RTX 4090); "
                             f"this one is {major}.{minor}: set train.float8=false")


def _wanted(module: nn.Module, fqn: str) -> bool:
    parts = fqn.split(".")
    return (isinstance(module, nn.Linear) and not any(part in parts for part in EXCLUDED)
            and not any(part.startswith("lora_") for part in parts)  # LoRA's own A / B stay bf16
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_float8(model: nn.Module, recipe: str) -> int:
    """Swap the blocks' Linear layers of `model` (on meta or materialised) for Float8Linear; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=_wanted)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def _cacheable(module: nn.Module) -> bool:
    """A frozen, unsharded, bias-free tensorwise Float8Linear: its weight's float8 cast never changes."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    weight = module._parameters.get("weight") if type(module) is Float8Linear else None
    return (weight is not None and not weight.requires_grad and not isinstance(weight, DTensor)
            and module.bias is None
            and module.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE)


def _cache_one(module: nn.Module, free: bool) -> None:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    dtype = module.config.cast_config_weight.target_dtype
    weight_t = hp_tensor_to_float8_dynamic(module.weight.detach().t(), dtype, module.linear_mm_config,
                                           gemm_input_role=GemmInputRole.WEIGHT)
    module.register_buffer("weight_float8_t", weight_t, persistent=False)
    module.__class__ = frozen_float8_linear()
    if free:
        module.weight.untyped_storage().resize_(0)


def cache_frozen_weights(model: nn.Module, free: bool = True) -> int:
    """Cast each frozen tensorwise Float8Linear's weight to float8 once (a frozen weight's scale never changes) and
    let its forward pass that cast to torchao's matmul, which takes an already-cast weight as it is, in the forward
    and for the input's gradient: the same numbers as casting every call, without the ~5 bytes moved per weight
    three times a step. `free` releases the bf16 weight's storage (the parameter keeps its shape and name; nothing
    reads a frozen base's values after this but its forward). Weights sharded as DTensors, trainable ones and
    rowwise layers (two casts of different layout) are left alone. Returns how many layers were cached."""
    modules = [m for m in model.modules() if _cacheable(m) and not m.weight.is_meta]
    for module in modules:
        _cache_one(module, free)
    return len(modules)


def take_frozen_weights(model: nn.Module) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """peft.base_dtype: float8, before the backend loads the model: take the cacheable layers' (meta) weights out
    of it, so that loading does not allocate the whole bf16 base at once; load_frozen_weights puts each back as its
    float8 cast, one layer's bf16 at a time. Returns (parameter name, module, meta weight)."""
    taken = []
    for name, module in model.named_modules():
        if _cacheable(module):
            taken.append((f"{name}.weight", module, module._parameters.pop("weight")))
    return taken


def load_frozen_weights(taken: list[tuple[str, nn.Module, torch.Tensor]], source: Any, device: torch.device) -> int:
    """Read each taken weight from `source` (models/weights.WeightSource) onto `device`, put it back in its module
    and keep only its float8 cast (cache_frozen_weights' per layer). Returns how many layers."""
    for name, module, meta in taken:
        weight = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        weight.copy_(source.rows(name, meta.shape, 0, meta.shape[0], meta.dtype))
        module.weight = nn.Parameter(weight, requires_grad=False)
        _cache_one(module, free=True)
    return len(taken)


@functools.cache
def frozen_float8_linear() -> type:
    """FrozenFloat8Linear, made on first use (torchao is imported only where float8 is used)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(t: torch.Tensor, cast_config: Any, mm_config: Any, config: Any, role: Any) -> torch.Tensor:
        return hp_tensor_to_float8_dynamic(
            t, cast_config.target_dtype, mm_config, gemm_input_role=role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(-1, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)

    class FrozenMatmul(torch.autograd.Function):
        """torchao's matmul_with_hp_or_float8_args for a frozen, already-cast weight: the same input and
        output-gradient casts and matmuls, without the weight's gradient (torchao forms it whatever the weight;
        compiled blocks drop it, eager ones would pay a third float8 matmul for nothing)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight_t: torch.Tensor, mm_config: Any, config: Any) -> torch.Tensor:
            ctx.save_for_backward(weight_t)
            ctx.mm_config, ctx.config = mm_config, config
            x8 = cast(x, config.cast_config_input, mm_config, config, GemmInputRole.INPUT)
            out = torch.mm(x8.reshape(-1, x8.shape[-1]), weight_t)
            return out.reshape(*x8.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            (weight_t,) = ctx.saved_tensors
            g8 = cast(grad.reshape(-1, grad.shape[-1]), ctx.config.cast_config_grad_output, ctx.mm_config,
                      ctx.config, GemmInputRole.GRAD_OUTPUT)
            grad_input = torch.mm(g8, weight_t.t())
            return grad_input.reshape(*grad.shape[:-1], grad_input.shape[-1]), None, None, None

    class FrozenFloat8Linear(Float8Linear):
        """A Float8Linear whose frozen weight was cast once (cache_frozen_weights): its forward uses that cast."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled(input.device.type):  # as Float8Linear.forward
                input = input.to(torch.get_autocast_dtype(input.device.type))
            return FrozenMatmul.apply(input, self.weight_float8_t, self.linear_mm_config, self.config)

    return FrozenFloat8Linear
