"""Weight sources and per-shard loading.

A WeightSource hands out row ranges of named tensors. After a backend has sharded the meta model
and `to_empty` has given every rank storage for its own shard, `load_weights` fills each local
shard with just its rows, read straight from the safetensors files (or generated for a preset),
so host memory holds one parameter slice at a time, never the whole model.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardtune.dist import shard_mesh_dim
from shardtune.errors import ShardtuneError
from shardtune.models.build import assert_no_meta, restore_buffers


class WeightSource(Protocol):
    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [start, stop) along dim 0 of tensor `name` of full shape `shape`. `dtype`: what the caller keeps
        them in, a hint: a source that makes its rows may make them in it; a file's rows come in the file's dtype."""
        ...


class SafetensorsSource:
    """Reads slices from a Hugging Face directory: model.safetensors, or shards with an index."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - not a dict
        else:
            raise ShardtuneError(f"model.path: {str(self.path)!r} has no model.safetensors or "
                                 "model.safetensors.index.json; shardtune loads safetensors weights only")
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise ShardtuneError(f"model.path: checkpoint {str(self.path)!r} has no tensor {name!r}; "
                                 "it does not match the architecture in its config.json")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, framework="pt")
        piece = self._open[file].get_slice(name)
        if list(piece.get_shape()) != list(shape):
            raise ShardtuneError(f"model.path: tensor {name!r} has shape {piece.get_shape()} in the checkpoint but "
                                 f"{list(shape)} in the model built from config.json")
        return piece[start:stop] if len(shape) else piece[:]


class RandomInitSource:
    """Seeded random init, independent of world size: each tensor is drawn whole from a generator
    seeded by (seed, name), then sliced. Matches transformers' Llama init (normal(0, std),
    norms to one, biases to zero)."""

    def __init__(self, std: float, seed: int, device: torch.device | str = "cpu") -> None:
        self.std, self.seed, self.device = std, seed, torch.device(device)

    def full(self, name: str, shape: torch.Size, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape, device=self.device, dtype=self.draw_dtype(dtype)).normal_(0.0, self.std,
                                                                                           generator=gen)

    def draw_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """On an accelerator a tensor is drawn in the dtype its parameter keeps: an fp32 draw of the 8B's 128k x
        4,096 embedding was a 1.96 GiB temporary beside the whole loaded model, the peak of 8B LoRA's run (17.13
        GiB at micro-batch 2 and 3 alike, one H100, call 125). On a CPU the draw stays fp32, cast by the caller:
        a bf16 draw there gives other values for some shapes, and init-model's files equal the fp32 draw."""
        return dtype if dtype is not None and self.device.type != "cpu" else torch.float32

    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.full(name, shape, dtype)[start:stop]


@dataclass(frozen=True)
class TensorLoader:
    """How `load_weights` fills parameters that are not plain tensors (QLoRA's NF4 weights), registered by
    the package that makes such parameters, so this loader needs to know none of them.

    matches:   whether a parameter is one of them.
    load_rows: fills the parameter's local shard from its full-precision rows (may be a collective: every
               rank calls it for the same parameters in the same order).
    unloaded:  the names of such parameters a model still holds unloaded (assert_no_meta cannot see them).
    """

    name: str
    matches: Callable[[torch.Tensor], bool]
    load_rows: Callable[[torch.Tensor, torch.Tensor], None]
    unloaded: Callable[[nn.Module], list[str]]


_LOADERS: dict[str, TensorLoader] = {}


def register_tensor_loader(loader: TensorLoader) -> None:
    _LOADERS[loader.name] = loader


def _loader_for(param: torch.Tensor) -> TensorLoader | None:
    return next((loader for loader in _LOADERS.values() if loader.matches(param)), None)


def make_source(mcfg: Any, hf_config: Any, device: torch.device) -> WeightSource:
    """The source a run's model config names: a local HF directory or a preset's random init."""
    if mcfg.path is not None:
        return SafetensorsSource(mcfg.path)
    # Generate on the accelerator when there is one: drawing 8 B normals on a CPU takes minutes.
    return RandomInitSource(getattr(hf_config, "initializer_range", 0.02), mcfg.seed, device)


def shard_rows(t: torch.Tensor) -> tuple[int, int]:
    """Row range [start, stop) of the full tensor that this rank's local shard holds.

    FSDP2 shards dim 0 like torch.chunk: every rank but the last holds ceil(n / world) rows.
    """
    if not isinstance(t, DTensor):
        return 0, t.shape[0] if t.dim() else 0
    dim = shard_mesh_dim(t)
    n, world = t.shape[0], t.device_mesh.size(dim)
    rank = t.device_mesh.get_local_rank(dim)
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


@torch.no_grad()
def load_weights(model: nn.Module, source: WeightSource | None, device: torch.device) -> None:
    """Materialise a (possibly sharded) meta model on `device` and fill each rank's shard from `source`.

    source=None only allocates (a checkpoint is about to overwrite every parameter)."""
    shared = shared_parameters(model)
    model.to_empty(device=device)
    retie(model, shared)
    restore_buffers(model, device)
    for name, param in model.named_parameters() if source is not None else ():
        local = param.to_local() if isinstance(param, DTensor) else param
        start, stop = shard_rows(param)
        if param.dim() and local.shape[0] != stop - start:
            raise AssertionError(f"{name}: local shard has {local.shape[0]} rows, expected {stop - start}")
        loader = _loader_for(param)
        rows = source.rows(name, param.shape, start, stop, None if loader else local.dtype)
        if loader is not None:
            loader.load_rows(param, rows)  # NF4: collective, quantizes this rank's rows with the whole weight's mean
        else:
            local.copy_(rows)
        del rows  # before the next tensor's rows are made: one tensor's rows alive at a time (tests/gpu)
    assert_no_meta(model)
    for loader in _LOADERS.values():
        left = loader.unloaded(model)
        if left:
            raise RuntimeError(f"{len(left)} {loader.name} weights were not loaded, e.g. {left[:3]}")



def shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one shared parameter (tied embeddings)."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append((module, attr))
    return [g for g in groups.values() if len(g) > 1]


def retie(model: nn.Module, shared: list[list[tuple[nn.Module, str]]]) -> None:
    """`to_empty` gives every module its own new tensor, which unties tied weights: tie them again."""
    for (first, first_attr), *rest in shared:
        param = first._parameters[first_attr]
        for module, attr in rest:
            if module._parameters[attr] is not param:
                module._parameters[attr] = param
