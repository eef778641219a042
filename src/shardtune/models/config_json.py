"""A model's config as the planner needs it, read without transformers where that is enough.

In transformers 5 even `AutoConfig.for_model` imports torch (~3.5 s; ~14 s with the rest on a cold GPU node), and
`shardtune plan` should answer on a login node in a second or two. For the families whose block layout
models.facts knows, config.json (or a preset) is read as JSON, with transformers' class defaults for the keys it
leaves out; any other model, a folder with its own code, or a config without its sizes goes through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from shardtune.models.facts import ARCH_FACTS, SIZE_KEYS
from shardtune.models.presets import PRESETS

if TYPE_CHECKING:
    from shardtune.config import ModelConfig


def read_raw(mcfg: ModelConfig) -> dict[str, Any] | None:
    """The preset's dict or the folder's config.json as JSON; None where only transformers can read it (no file,
    not JSON, or the folder's own code is to run)."""
    if mcfg.preset is not None:
        return dict(PRESETS[mcfg.preset])
    if mcfg.trust_remote_code:
        return None
    try:
        raw = json.loads((Path(mcfg.path or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None  # load_hf_config reports it in its own words
    return raw if isinstance(raw, dict) else None


def light_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """config.json's values over the family's defaults, with the derived widths filled in as transformers' config
    class does; None unless the family's layout is known and the sizes are stated (custom code, `auto_map`, is
    left to transformers, which warns about it)."""
    facts = ARCH_FACTS.get(raw.get("model_type", ""))
    if facts is None or facts.layout is None or raw.get("auto_map") or raw.get("is_encoder_decoder"):
        return None
    if any(not isinstance(raw.get(key), int) for key in SIZE_KEYS):
        return None
    values = {**facts.layout.defaults, **raw}
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    return SimpleNamespace(**values)


def planning_config(mcfg: ModelConfig) -> Any:
    """The config `plan` prices: the light one where it applies, else transformers' (load_hf_config's checks)."""
    raw = read_raw(mcfg)
    light = light_config(raw) if raw is not None else None
    if light is not None:
        return light
    from shardtune.models.build import load_hf_config

    return load_hf_config(mcfg)
