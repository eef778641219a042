"""The planner's parameter count from config.json alone (models/config_json.py + plan/shape.py's layout rules)
against a meta-device build of the same config by transformers, for every family with a known layout; and that
`shardtune plan` then answers without importing torch, transformers or deepspeed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from transformers import AutoConfig

from shardtune.config import load_config
from shardtune.models.config_json import light_config, planning_config, read_raw
from shardtune.models.facts import ARCH_FACTS
from shardtune.models.presets import PRESETS, preset_config
from shardtune.plan.shape import _built, model_shape

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted(name for name, facts in ARCH_FACTS.items() if facts.layout is not None)
# Small sizes; 32 heads so every family's default kv-head count (4 to 32) divides them.
SIZES = {"hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 32,
         "vocab_size": 300}
VARIANTS = {
    "class defaults": {},
    "explicit widths, biases, tie flipped": {"num_key_value_heads": 8, "head_dim": 16, "attention_bias": True,
                                             "mlp_bias": True, "flip_tie": True},
}
PLANNER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")


def _raw(family: str, variant: dict) -> dict:
    raw = {"model_type": family, **SIZES, **{k: v for k, v in variant.items() if k != "flip_tie"}}
    if variant.get("flip_tie"):
        raw["tie_word_embeddings"] = not ARCH_FACTS[family].layout.defaults["tie_word_embeddings"]
    return raw


def _hf(raw: dict):
    return AutoConfig.for_model(**raw)


def test_every_family_with_a_layout_is_listed() -> None:
    assert set(FAMILIES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite"}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_light_config_reads_what_transformers_reads(family: str, variant: str) -> None:
    raw = _raw(family, VARIANTS[variant])
    light, hf = light_config(raw), _hf(raw)
    assert light is not None
    for key in PLANNER_KEYS:  # a config class without head_dim (granite) derives it as the planner does
        expected = getattr(hf, key, None)
        if key == "head_dim" and expected is None:
            expected = hf.hidden_size // hf.num_attention_heads
        assert getattr(light, key) == expected, key


@pytest.mark.parametrize("targets", [None, "all-linear", ["q_proj", "v_proj"]], ids=["default", "all", "qv"])
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_counted_shape_equals_the_meta_build(family: str, variant: str, targets) -> None:
    raw = _raw(family, VARIANTS[variant])
    counted = model_shape(light_config(raw), targets, lora_r=8)
    built = _built(_hf(raw), targets if targets is not None else list(ARCH_FACTS[family].lora_targets), 8)
    for f in fields(counted):
        assert getattr(counted, f.name) == getattr(built, f.name), f.name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_counts_the_same_both_ways(preset: str) -> None:
    mcfg = load_config(str(ROOT / "examples" / "tiny.yaml"), [f"model.preset={preset}"]).model
    light = planning_config(mcfg)
    assert not hasattr(light, "to_dict")  # the JSON path, not transformers
    assert model_shape(light) == _built(preset_config(preset), list(ARCH_FACTS["llama"].lora_targets), 16)


def test_what_json_cannot_price_goes_through_transformers(tmp_path) -> None:
    """Unknown layouts (gpt2, phi3), configs without their sizes, and folders with their own code."""
    mcfg = load_config(str(ROOT / "examples" / "tiny.yaml")).model
    for raw in ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300},
                {"model_type": "llama", "hidden_size": 64},
                {"model_type": "llama", **SIZES, "auto_map": {"AutoConfig": "x.Config"}}):
        assert light_config(raw) is None
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                  "vocab_size": 300}))
    mcfg = load_config(str(ROOT / "examples" / "tiny.yaml"), [f"model.path={gpt2}", "model.preset=null"]).model
    hf = planning_config(mcfg)
    assert hasattr(hf, "to_dict") and model_shape(hf).layers == 2
    remote = load_config(str(ROOT / "examples" / "tiny.yaml"),
                         [f"model.path={gpt2}", "model.preset=null", "model.trust_remote_code=true"]).model
    assert read_raw(remote) is None


def test_plan_imports_no_torch_transformers_or_deepspeed(tmp_path) -> None:
    """`plan` on a login node: a preset and a model folder, full fine-tuning on DeepSpeed (with a `deepspeed:`
    section) and LoRA, priced and picked without the heavy imports (each is seconds on a cold node)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **PRESETS["llama-3.2-1b"]}))
    runs = [["plan", str(ROOT / "examples" / "llama-8b-deepspeed-offload.yaml"), "--gpu", "h100", "--nproc", "8"],
            ["plan", str(ROOT / "examples" / "tiny.yaml"), f"model.path={folder}", "model.preset=null",
             "peft.method=lora", "--gpu", "h200", "--nproc", "2"],
            ["plan", str(ROOT / "examples" / "tiny.yaml"), "log.memory_snapshot=[3,3]", "parallel.compile=false",
             "parallel.activation_checkpointing=full", "--gpu", "h200"]]  # compile's advice asks torch's version
    heavy = "sorted(m for m in ('torch', 'transformers', 'deepspeed', 'peft') if m in sys.modules)"
    code = (f"import sys\nfrom shardtune.cli import main\nfor argv in {runs!r}:\n    assert main(argv) == 0\n"
            f"print('HEAVY', {heavy})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("\npick ") == 3, out.stdout[-2000:]
