"""LoRA through PEFT, applied to the meta-device model before sharding.

PEFT wraps the model (`base_model.model.` prefix, `.base_layer` in wrapped linears, adapter
weights `lora_A.default` / `lora_B.default`) and freezes everything but the adapters. The
functions here map those names back to the checkpoint's, initialise the adapters independent of
world size, and gather the adapter in PEFT's own format from a sharded model (checkpoint/hf_export.py's
save_adapter writes it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtune.config import PeftConfig
from shardtune.models.facts import ARCH_FACTS

_PREFIX = "base_model.model."
_LORA = re.compile(r"\.lora_(A|B|magnitude_vector)\.[^.]+(\.weight)?$")


def lora_config(cfg: PeftConfig, model_type: str) -> Any:
    """The peft.LoraConfig a run asks for; `auto` targets come from the architecture facts table."""
    from peft import LoraConfig

    targets: Any = cfg.target_modules
    if targets == "auto":
        facts = ARCH_FACTS.get(model_type)
        targets = list(facts.lora_targets) if facts else "all-linear"
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      use_dora=cfg.use_dora, bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, cfg: PeftConfig, model_type: str) -> nn.Module:
    """Wrap a (meta-device) causal LM with LoRA adapters; only the adapters stay trainable."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(cfg, model_type))
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise RuntimeError("LoRA matched no module: nothing would train; check peft.target_modules")
    return wrapped


def frozen_dtype(base_dtype: str, precision: str) -> torch.dtype:
    """The storage dtype of the frozen base: `peft.base_dtype`, auto = the compute precision."""
    name = precision if base_dtype in ("auto", "float8") else base_dtype  # float8: cast once loaded
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter (NF4 ones excepted) in `dtype`, keeping tied
    parameters tied; on a meta model this only changes what `to_empty` will allocate. Mixed
    precision casts the base to the compute dtype for every matmul anyway: an fp32 copy of a frozen
    weight only costs memory (an 8B base: 32 GB in fp32, 16 GB in bf16). Returns the count cast."""
    from shardtune.peft.qlora import is_nf4

    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None or p.requires_grad or is_nf4(p) or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[attr] = done[id(p)]
    return len(done)


def base_name(name: str) -> str:
    """A PEFT parameter name -> the name of the same tensor in the base model's checkpoint."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return _LORA.search(name) is not None


class LoraSource:
    """Weights for a LoRA-wrapped model: base tensors from the base source, adapters initialised as
    PEFT does (A ~ kaiming_uniform(a=sqrt(5)), B = 0, DoRA magnitude = row norms of the base
    weight), drawn from a generator seeded per name, so any world size starts from the same model."""

    def __init__(self, base: Any, seed: int, shapes: dict[str, torch.Size]) -> None:
        self.base, self.seed, self.shapes = base, seed, shapes  # shapes: base-model name -> full shape

    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        m = _LORA.search(name)
        if m is None:
            return self.base.rows(base_name(name), shape, start, stop, dtype)
        kind = m.group(1)
        if kind == "B":
            return torch.zeros((stop - start, *shape[1:]))
        if kind == "magnitude_vector":
            weight_name = base_name(name[:m.start()]) + ".weight"
            weight_shape = self.shapes[weight_name]
            full = self.base.rows(weight_name, weight_shape, 0, weight_shape[0])
            return full.float().norm(dim=1)[start:stop]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + _crc(name))
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)[start:stop]


def _crc(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def adapter_state(model: nn.Module, rank: int,
                  gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
    """Collective: gather every adapter tensor in full (`gather`: the backend's full_tensor; default
    the DTensor gather); rank 0 gets PEFT's saved-format state (adapter name stripped), the others None."""
    from shardtune.fileio import full_tensor

    gather = gather or full_tensor
    full = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        t = gather(param)
        if rank == 0:
            full[name] = t.to("cpu", torch.float32).contiguous()
    if rank != 0:
        return None
    from peft.utils import get_peft_model_state_dict
    from peft.utils.other import EMBEDDING_LAYER_NAMES

    # PEFT's "auto" saves the embedding where it is adapted, and otherwise looks the base's config.json up to see
    # whether the vocabulary was resized: on the Hub where the base is no local folder (a preset's name), a network
    # call at each save. shardtune never resizes the vocabulary, so only an adapted embedding is saved.
    adapted = any(part in EMBEDDING_LAYER_NAMES for name in full for part in name.split("."))
    return get_peft_model_state_dict(model, state_dict=full, save_embedding_layers="auto" if adapted else False)



def adapter_base(model_cfg: Any) -> tuple[str, str]:
    """What an adapter names as its base (adapter_config.json's base_model_name_or_path) and the README.md beside
    it: the base folder's absolute path, or for a preset (random init, no folder) its name and how to rebuild the
    same weights with `shardtune init-model`, since nothing can load a preset's name."""
    from pathlib import Path

    load = ("```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
            "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER_DIR)\n```\n")
    if model_cfg.path:
        path = str(Path(model_cfg.path).expanduser().resolve())
        return path, f"# LoRA adapter (shardtune)\n\nBase model: `{path}`.\n\n{load.replace('BASE', repr(path))}"
    preset, seed = model_cfg.preset, model_cfg.seed
    return preset, (f"# LoRA adapter (shardtune)\n\nBase model: shardtune's `{preset}` preset, random init with seed "
                    f"{seed} (no folder). Write the same weights with\n\n```bash\nshardtune init-model BASE --preset "
                    f"{preset} --seed {seed}\n```\n\nthen load:\n\n{load.replace('BASE', repr('BASE'))}")
