"""Model config checks and the meta-device build.

The model is built on the meta device (no memory), sharded by a backend, and only then
materialised shard by shard (see weights.py), so a large model never exists whole in one process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.config import ModelConfig
from shardtune.errors import ShardtuneError
from shardtune.models.presets import preset_config


def load_hf_config(mcfg: ModelConfig) -> Any:
    """The transformers config of the model a run names, checked to be a decoder-only causal LM."""
    if mcfg.preset is not None:
        cfg = preset_config(mcfg.preset)
    else:
        path = Path(mcfg.path or "")
        if not (path / "config.json").is_file():
            raise ShardtuneError(f"model.path: {str(path)!r} has no config.json; point it at a local Hugging Face "
                                 "model directory, or create one with `shardtune init-model DIR --preset tiny-llama`")
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ShardtuneError(f"model.path: cannot read {str(path / 'config.json')!r}: {first}") from None
    check_causal_lm(cfg)
    return cfg


def check_causal_lm(cfg: Any) -> None:
    """Refuse encoder-decoder and non-causal-LM architectures with a message naming the fix."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(cfg, "model_type", "?")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ShardtuneError(f"model: {kind!r} is an encoder-decoder model; shardtune fine-tunes decoder-only causal "
                             "LMs (AutoModelForCausalLM) such as Llama, Qwen or Mistral; use a seq2seq trainer for it")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ShardtuneError(f"model: {kind!r} has no causal-LM head in transformers (AutoModelForCausalLM); "
                             "shardtune fine-tunes decoder-only causal LMs such as Llama, Qwen or Mistral")


def build_on_meta(cfg: Any, attn_implementation: str = "sdpa") -> nn.Module:
    """Build the model on the meta device in fp32 (parameters are kept in fp32 for training)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn_implementation)
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
