"""QLoRA base weights: 4-bit NF4 (torchao `NF4Tensor`) sharded by FSDP2, LoRA adapters on top.

Why torchao's NF4Tensor and not bitsandbytes' `Params4bit`
-----------------------------------------------------------
FSDP2 shards a parameter by chunking it along dim 0 and rebuilds it before use by all-gathering
the chunks. `NF4Tensor` implements FSDP2's tensor-subclass extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`) and the aten ops `fully_shard` applies (`split`, `new_zeros`, `copy_`,
`view`, `empty_like`): each of its three data tensors (4-bit codes, int8 block scalers, per-
scaler-block factors) is chunked and all-gathered on its own, the rebuilt weight is an NF4Tensor
again, and no dtype cast ever touches the packed bytes. This is the torchtune / torchao route.

bitsandbytes' `Params4bit` implements none of that: to FSDP2 it is an ordinary tensor of packed
bytes whose meaning lives in a Python-side `quant_state` (absmax per block, original shape,
code book). With the default uint8 storage `fully_shard` fails outright (an integer tensor cannot
be a parameter that requires grad); with a float `quant_storage`, FSDP2 chunks, pads, all-gathers
and mixed-precision-casts the packed bytes as if they were numbers (bf16/fp16 casts and NaN
canonicalisation rewrite some of them), rebuilds a plain `nn.Parameter` without the subclass and
its `quant_state`, and leaves every rank's `quant_state` describing the whole, unsharded weight.
`Linear4bit` then dequantizes garbage, which is how axolotl #1482 and accelerate #3983 show up:
loss 0.0 and a NaN grad norm, silently, after a "successful" start.

Where quantization happens, and how loading changes
---------------------------------------------------
On the meta model, before `fully_shard` (`quantize_to_nf4`): FSDP2 decides at `fully_shard`
time whether a parameter uses the all-gather extensions, so the NF4Tensor must already be the
parameter then; swapping it in afterwards would bypass FSDPParam's bookkeeping. On meta this
costs nothing (no data; 8B shapes take milliseconds).

`to_empty` then gives every rank empty storage for its share of the three data tensors, but
leaves the two per-tensor extras (the double-quantisation mean and the 16-entry NF4 code book)
on the meta device, because NF4's `empty_like` only touches the sharded tensors. The per-shard
loader must therefore call `load_nf4_rows(param, rows)` for NF4 parameters instead of
`param.to_local().copy_(rows)`. Plain `copy_` runs (NF4 quantizes a float source) but is wrong
twice over:

  * it quantizes the rank's rows on their own, so the double-quantisation mean (one scalar per
    weight, the mean of all 64-element block maxima) differs per rank, while FSDP2's all-gather
    rebuilds the full weight with the *local* rank's mean for every row: other ranks' rows come
    back with wrong scales, and each rank sees a different "full" weight;
  * the mean and code book it copies land on the meta tensors `to_empty` left (a silent no-op;
    the first forward then fails with "Tensor on device meta is not on the expected device").

`load_nf4_rows` quantizes only this rank's rows (the shard never exists in full precision
beyond the rows handed in), with the mean of the whole tensor from one scalar all-reduce over
the parameter's mesh. The 4-bit codes and scalers it writes equal those of `to_nf4(full weight)`
split FSDP2's way (codes and scalers bit-identical in the tests; the mean is summed in float64,
so it may differ from torchao's fp32 mean in the last bit), and every rank rebuilds the same weight.
It is a collective: every rank must call it for the same parameters in the same order (the
loader's `named_parameters()` loop does).

Shapes: torchao's NF4 needs numel divisible by block_size * scaler_block_size, and FSDP2's NF4
sharding needs even row shards whose element count is a multiple of that product (each scaler
block must sit inside one shard). `quantize_to_nf4(..., shard_world=N)` halves the scaler block
size per weight until that holds (256 -> 128 -> ...; a smaller scaler block only costs a few
more bytes of scalers) and leaves a weight in full precision, with a warning, when even the
64-element block does not fit. Llama-3.2-1B / Llama-3-8B projections on 2-8 ranks keep 256;
Qwen2.5-0.5B's k/v projections (128 x 896) get 128 on 2 ranks.

Mixed precision (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`)
-----------------------------------------------------------------------------
For an NF4 parameter FSDP2 takes the all-gather path of the extension: it all-gathers the
uint8/int8/fp32 data tensors as they are (never cast to param_dtype) and passes param_dtype to
`fsdp_post_all_gather`, which ignores it (the NF4 weight keeps its original dtype as metadata).
The linear layer (`NF4Linear`, nf4_linear.py: one fused dequantization kernel on CUDA instead
of torchao's eager `linear_nf4`, same arithmetic) dequantizes to the *activation* dtype, so under
a bf16 policy the matmul runs in bf16 like every other layer, and in fp32 under fp32. LoRA A/B
parameters are ordinary fp32 parameters: cast to bf16 for the all-gather, gradients reduce-
scattered in fp32, the optimizer keeps fp32 masters; the other frozen parameters (norms,
embeddings) are stored in `peft.base_dtype` (bf16 under bf16). NF4 parameters never get a
gradient (requires_grad False), so they are never
reduce-scattered; their bytes are not changed by training.

Checkpoints and export: NF4 parameters are frozen, so `StateDictOptions(ignore_frozen_params=True)`
leaves them out of DCP checkpoints (re-read from the base model on resume); `nf4_full_weight`
gathers one NF4 weight and dequantizes it (for merging LoRA into an exported model).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtune.dist import shard_mesh_dim
from shardtune.models.weights import TensorLoader, register_tensor_loader
from shardtune.peft.nf4_linear import NF4Linear

# torchao's wheels carry CUDA kernels built for one torch version; NF4 and the 8-bit optimizers are
# pure Python. Skip loading the kernels unless the user chose otherwise (it only prints warnings on
# CPU builds or other torch versions).
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

__all__ = ["is_nf4", "load_nf4_rows", "nf4_available", "nf4_bytes", "nf4_full_weight", "nf4_params",
           "nf4_round_trip", "nf4_scaler_block_size", "nf4_shard_world", "nf4_unmaterialised", "quantize_to_nf4"]


def _nf4_api() -> tuple[type, Callable[..., Any]]:
    """(NF4Tensor, to_nf4) from torchao: `torchao.quantization` (0.18) or `torchao.dtypes.nf4tensor`
    (0.16 and older; both tested)."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError as err:
            raise ImportError("peft.method=qlora needs torchao >= 0.16 (pip install -e '.[qlora]')") from err
    return NF4Tensor, to_nf4


def nf4_available() -> bool:
    try:
        _nf4_api()
    except ImportError:
        return False
    return True


def is_nf4(t: Any) -> bool:
    """True for an NF4Tensor, or a DTensor whose local shard is one."""
    if t is None:
        return False
    local = getattr(t, "_local_tensor", t)
    return type(local).__name__ == "NF4Tensor" and hasattr(local, "quantized_data")


def _local(t: torch.Tensor) -> Any:
    # The very object FSDP2 all-gathers from (DTensor._local_tensor), not a view of it: attributes
    # set here (the mean, the code book) must be seen by fsdp_pre_all_gather.
    return getattr(t, "_local_tensor", t)


def nf4_scaler_block_size(shape: tuple[int, ...] | torch.Size, shard_world: int = 1, *, block_size: int = 64,
                          scaler_block_size: int = 256) -> int | None:
    """The largest scaler block size <= `scaler_block_size` (halving) with which a weight of `shape`
    can be NF4-quantized and sharded over `shard_world` ranks, or None when it cannot."""
    if len(shape) != 2 or shape[0] % shard_world:
        return None
    shard_numel = shape[0] // shard_world * shape[1]
    sbs = scaler_block_size
    while sbs >= 1:
        if shard_numel % (block_size * sbs) == 0:
            return sbs
        sbs //= 2
    return None


def nf4_shard_world(param_shards: int) -> int:
    """The `shard_world` a run quantizes its base for, when FSDP2 splits each weight over `param_shards`
    ranks (1: not split). Scaler blocks are sized for lcm(shards, 8), so 1, 2, 4 or 8 processes (and any
    resume among them) quantize the base identically."""
    return math.lcm(param_shards, 8)


def nf4_round_trip(weight: torch.Tensor, shard_world: int) -> torch.Tensor:
    """`weight` quantized to NF4 as a run over `shard_world` (nf4_shard_world) quantized it, and dequantized
    (fp32); a weight the run left in full precision comes back as it is."""
    _, to_nf4 = _nf4_api()
    sbs = nf4_scaler_block_size(weight.shape, shard_world)
    return weight if sbs is None else to_nf4(weight.contiguous(), 64, sbs).get_original_weight().float()


def quantize_to_nf4(model: nn.Module, target_names: Callable[[str], bool], *, block_size: int = 64,
                    scaler_block_size: int = 256, shard_world: int = 1) -> list[str]:
    """Replace the weight of every `nn.Linear` whose module name matches with a frozen NF4 parameter.

    On a meta model (the sharded-training path) the NF4 parameter is an empty skeleton of the right
    shapes, to be filled by `load_nf4_rows` after `fully_shard` + `to_empty`. On a materialised model
    (one process) the weight is quantized in place of the original, one linear at a time.

    Call it after PEFT's `get_peft_model` with `lambda name: name.endswith(".base_layer")` (the
    linears that LoRA wraps), or before it with the target projections' names: PEFT wraps an
    nn.Linear whose weight is an NF4Tensor as it wraps any other.

    shard_world: the FSDP2 world size the model will be sharded over; picks per weight a scaler block
    size that divides each rank's shard (see `nf4_scaler_block_size`). Biases stay in full precision.
    Returns the names of the quantized modules.
    """
    _, to_nf4 = _nf4_api()
    done, skipped = [], []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not target_names(name) or is_nf4(module.weight):
            continue
        weight = module.weight
        sbs = nf4_scaler_block_size(weight.shape, shard_world, block_size=block_size,
                                    scaler_block_size=scaler_block_size)
        if sbs is None:
            skipped.append(f"{name} {tuple(weight.shape)}")
            continue
        with torch.no_grad():
            nf4 = to_nf4(weight.detach().contiguous(), block_size, sbs)
        module.weight = nn.Parameter(nf4, requires_grad=False)
        if type(module) is nn.Linear:
            module.__class__ = NF4Linear  # the fused dequantization (nf4_linear.py); same parameters
        done.append(name)
    if skipped:
        warnings.warn(f"NF4: {len(skipped)} linear weights left in full precision: their rows do not split into "
                      f"{shard_world} shards of whole {block_size}-element blocks, e.g. {skipped[:3]}", stacklevel=2)
    return done


_LUTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nf4_code_book(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torchao's 16 NF4 values, in `dtype` on `device` (taken from torchao, not copied, so they match)."""
    key = (dtype, device)
    if key not in _LUTS:
        _, to_nf4 = _nf4_api()
        _LUTS[key] = to_nf4(torch.arange(128, dtype=dtype, device=device), 64, 2).nf4
    return _LUTS[key]


@torch.no_grad()
def load_nf4_rows(param: torch.Tensor, rows: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> None:
    """Fill this rank's shard of an NF4 parameter from its full-precision rows `rows`.

    `param` is the parameter as `model.named_parameters()` yields it after `fully_shard` + `to_empty`
    (a DTensor whose local tensor is an NF4Tensor), or a plain NF4Tensor in one process. `rows` are
    this rank's rows of the full weight (`models.weights.shard_rows(param)`), any float dtype, any
    device. Collective over the parameter's mesh (`group` overrides): one scalar all-reduce for the
    double-quantisation mean of the whole weight.
    """
    if not is_nf4(param):
        raise TypeError(f"load_nf4_rows: expected an NF4 parameter, got {type(_local(param)).__name__}")
    NF4Tensor, _ = _nf4_api()
    local = _local(param)
    if tuple(rows.shape) != tuple(local.shape):
        raise ValueError(f"load_nf4_rows: rows have shape {tuple(rows.shape)}, the local shard {tuple(local.shape)}")
    if group is None and hasattr(param, "device_mesh"):
        group = _shard_mesh(param).get_group()
    device, dtype = local.quantized_data.device, local.dtype
    bs, sbs = local.block_size, local.scaler_block_size
    x = rows.to(device=device, dtype=dtype).contiguous()
    n_blocks = x.numel() // bs

    # First level: the absmax of every 64-element block (the data's scales), and their mean over the
    # *whole* weight, so all ranks share it (FSDP2 rebuilds the full weight with one rank's mean).
    absmax = x.reshape(n_blocks, bs).abs().amax(dim=1)
    stats = torch.stack([absmax.double().sum(), torch.tensor(float(n_blocks), dtype=torch.float64, device=device)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    mean = (stats[0] / stats[1]).to(dtype)

    # Second level (double quantization), exactly as torchao's NF4Tensor.double_quantize_scalers does
    # it, per scaler block of `sbs` first-level scales (scaler blocks never cross a shard boundary).
    centred = (absmax - mean).view(-1, sbs)
    factor = 256 / (2 * centred.abs().amax(dim=1))
    scalers = (centred * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    code_book = _nf4_code_book(dtype, device)
    codes = NF4Tensor.convert_to_norm_float_weight(x, n_blocks, bs, code_book)

    local.quantized_data.copy_(codes)
    local.quantized_scalers.copy_(scalers)
    local.quantization_factor.copy_(factor)
    local.scaler_mean = mean
    local.nf4 = code_book


def _shard_mesh(param: Any) -> Any:
    """The 1-D mesh a sharded parameter's rows are split over: the whole mesh under FSDP2, the shard
    dimension under HSDP ((Replicate(), Shard(0)) placements), as FSDP2 hands it to NF4's all-gather."""
    mesh = param.device_mesh
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[shard_mesh_dim(param)]]


def nf4_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, parameter) of every NF4 parameter (sharded or not)."""
    for name, p in model.named_parameters():
        if is_nf4(p):
            yield name, p


def nf4_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for an NF4 weight (its local shard when sharded): 4-bit codes,
    int8 block scalers, per-scaler-block factors, the mean and the code book."""
    local = _local(t)
    return sum(x.numel() * x.element_size() for x in
               (local.quantized_data, local.quantized_scalers, local.quantization_factor, local.scaler_mean,
                local.nf4) if not x.is_meta)


def nf4_unmaterialised(model: nn.Module) -> list[str]:
    """NF4 parameters whose mean or code book is still on the meta device (not loaded by
    `load_nf4_rows`); `models.build.assert_no_meta` cannot see those."""
    return [n for n, p in nf4_params(model) if _local(p).scaler_mean.is_meta or _local(p).nf4.is_meta]


@torch.no_grad()
def nf4_full_weight(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole weight, dequantized, on every rank (collective when sharded: all-gathers the 4-bit
    data, ~1/8 of the bytes of an fp32 gather). For export (merging LoRA) and tests."""
    local = _local(param)
    mesh = _shard_mesh(param) if hasattr(param, "device_mesh") else None
    if mesh is not None and mesh.size() > 1:
        inputs, meta = local.fsdp_pre_all_gather(mesh)
        world = mesh.size()
        gathered = []
        for t in inputs:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=mesh.get_group())
            gathered.append(torch.cat(parts))
        full, _ = local.fsdp_post_all_gather(tuple(gathered), meta, local.dtype)
    else:
        full = local
    return full.get_original_weight().to(dtype or local.dtype)


register_tensor_loader(TensorLoader("NF4", is_nf4, load_nf4_rows, nf4_unmaterialised))
