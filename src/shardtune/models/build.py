"""Model config checks and the meta-device build.

The model is built on the meta device (no memory), sharded by a backend, and only then
materialised shard by shard (see weights.py), so a large model never exists whole in one process.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.config import ModelConfig
from shardtune.errors import ShardtuneError
from shardtune.models.presets import preset_config


def load_hf_config(mcfg: ModelConfig) -> Any:
    """The transformers config of the model a run names, checked to be a decoder-only causal LM.

    A model folder's own Python code runs only with `model.trust_remote_code: true`."""
    if mcfg.preset is not None:
        cfg = preset_config(mcfg.preset)
    else:
        path = Path(mcfg.path or "")
        if not (path / "config.json").is_file():
            raise ShardtuneError(f"model.path: {str(path)!r} has no config.json; point it at a local Hugging Face "
                                 "model directory, or create one with `shardtune init-model DIR --preset tiny-llama`")
        cfg = read_hf_config(path, trust_remote_code=mcfg.trust_remote_code, key="model.path")
    check_causal_lm(cfg)
    return with_positions(cfg, mcfg.max_position_embeddings, mcfg.rope_scaling)


def with_positions(cfg: Any, max_positions: int | None, rope_scaling: dict[str, Any] | None) -> Any:
    """The config with model.max_position_embeddings / model.rope_scaling applied, rebuilt through its class so
    transformers checks the RoPE settings. The scaling replaces the model's (its keys belong to its rope_type);
    the model's rope_theta stays. (Passing rope_scaling alone to transformers 5 drops rope_theta.)"""
    if max_positions is None and rope_scaling is None:
        return cfg
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    asked = rope_scaling or {}
    kind = asked.get("rope_type", asked.get("type", "default"))
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise ShardtuneError(f"model.rope_scaling: rope_type {kind!r} is not one transformers has; choose one of "
                             f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    values = cfg.to_dict()
    rope = dict(values.pop("rope_parameters", None) or values.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or values.get("rope_theta")
    if rope_scaling is not None:
        rope = dict(rope_scaling)
    values.update(rope_scaling=rope or None, rope_theta=theta)
    if max_positions is not None:
        values["max_position_embeddings"] = max_positions
    values.pop("model_type", None)
    try:
        return type(cfg)(**values)  # the model's own config class (also a folder's own code, when trusted)
    except (ValueError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ShardtuneError(f"model.rope_scaling: transformers refuses {rope_scaling}: {first}; give the keys "
                             "of its rope_type, e.g. {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, "
                             "high_freq_factor: 4.0, original_max_position_embeddings: 8192}") from None


TRUST_HINT = ("shardtune never runs a model folder's code unless model.trust_remote_code=true, which runs it with "
              "your permissions: set it only for a folder whose code you have read")


def read_hf_config(path: Path, *, trust_remote_code: bool = False, key: str = "model.path",
                   hint: str = TRUST_HINT) -> Any:
    """AutoConfig of a local folder, never running the folder's code unless `trust_remote_code`.

    A config.json with `auto_map` (custom code) and a model_type transformers does not know is refused
    before transformers could ask on the terminal whether to run it; with a known model_type the custom
    code is ignored, with a warning."""
    from transformers import AutoConfig

    if not trust_remote_code:
        check_custom_code(path, key, hint)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "custom code" in first:  # transformers' own refusal (trust_remote_code=False), e.g. via a parent class
            raise ShardtuneError(f"{key}: {str(path)!r} needs its own Python code to load; {hint}") from None
        raise ShardtuneError(f"{key}: cannot read {str(path / 'config.json')!r}: {first}") from None


_warned: set[str] = set()


def check_custom_code(path: Path, key: str = "model.path", hint: str = TRUST_HINT) -> None:
    """Refuse a folder whose config.json needs custom code (auto_map + a model_type transformers lacks);
    warn, once per folder, that the custom code of a known model_type is ignored."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # AutoConfig reports an unreadable file in its own words
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if not auto_map:
        return
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ShardtuneError(f"{key}: {str(path)!r} needs its own Python code (config.json has auto_map and "
                             f"model_type {model_type!r}, which transformers does not know); {hint}")
    if str(path) not in _warned and os.environ.get("RANK", "0") == "0":
        _warned.add(str(path))
        print(f"warning: {path / 'config.json'} names custom code (auto_map: {', '.join(auto_map)}); it is ignored "
              f"and transformers' own {model_type!r} classes are used (model.trust_remote_code=true would run it)",
              file=sys.stderr)


def check_causal_lm(cfg: Any) -> None:
    """Refuse encoder-decoder and non-causal-LM architectures with a message naming the fix."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(cfg, "model_type", "?")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ShardtuneError(f"model: {kind!r} is an encoder-decoder model; shardtune fine-tunes decoder-only causal "
                             "LMs (AutoModelForCausalLM) such as Llama, Qwen or Mistral; use a seq2seq trainer for it")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not (_remote_code(cfg) and
                                                                "AutoModelForCausalLM" in cfg.auto_map):
        raise ShardtuneError(f"model: {kind!r} has no causal-LM head in transformers (AutoModelForCausalLM); "
                             "shardtune fine-tunes decoder-only causal LMs such as Llama, Qwen or Mistral")


def _remote_code(cfg: Any) -> bool:
    """Whether `cfg` is an instance of a model folder's own config class: it exists only when that folder's
    code was allowed to run (model.trust_remote_code), so building its model may run the folder's code too."""
    return type(cfg).__module__.startswith("transformers_modules") and isinstance(getattr(cfg, "auto_map", None),
                                                                                dict)


def build_on_meta(cfg: Any, attn_implementation: str = "sdpa") -> nn.Module:
    """Build the model on the meta device in fp32 (parameters are kept in fp32 for training)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn_implementation,
                                                 trust_remote_code=_remote_code(cfg))
    return model


def restore_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute non-persistent buffers (e.g. RoPE inv_freq) that `to_empty` left uninitialised.

    They are not in any checkpoint; they come from the module's constructor. Transformers'
    buffer-owning modules (rotary embeddings) are constructed from `config` alone.
    """
    for name, module in model.named_modules():
        own = [b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None]
        if not own:
            continue
        try:
            fresh = type(module)(module.config)
        except Exception as err:
            raise RuntimeError(f"cannot rebuild buffers of {name or 'model'} ({type(module).__name__}): {err}") from err
        for bname in own:
            setattr(module, bname, getattr(fresh, bname).to(device))


def assert_no_meta(model: nn.Module) -> None:
    """After loading, nothing may be left on the meta device (torchtune's validate_no_params_on_meta_device)."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors still on the meta device after loading, e.g. {left[:3]}")


def write_config(model: nn.Module | str | None, hf_config: Any, tokenizer: Any, out: Path,
                 dtype: torch.dtype) -> None:
    """config.json (with architectures, dtype, special token ids), generation_config.json, tokenizer.

    `model` gives the architecture: a model, its class name, or None to keep the config's."""
    from transformers import GenerationConfig

    cfg = copy.deepcopy(hf_config)
    if model is not None:
        cfg.architectures = [model if isinstance(model, str) else type(model).__name__]
    cfg.dtype = dtype
    cfg.use_cache = True
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, key, None) is not None:
            setattr(cfg, key, getattr(tokenizer, key))
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
