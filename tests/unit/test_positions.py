"""Long-context settings: the llama-3.1-8b preset (131,072 positions, Llama 3.1's RoPE scaling) and
model.max_position_embeddings / model.rope_scaling over a preset or a local model, which keep the model's rope_theta
(transformers 5 drops it when rope_scaling is passed alone) and are refused in one line when transformers cannot
use them."""

from __future__ import annotations

import json

import torch
from conftest import ROOT

from shardtune.config import load_config
from shardtune.models.build import build_on_meta, load_hf_config
from shardtune.models.presets import preset_config
from shardtune.plan.shape import model_shape

TINY = str(ROOT / "examples" / "tiny.yaml")
LINEAR = ["model.max_position_embeddings=16384", "model.rope_scaling={rope_type: linear, factor: 4.0}"]


def _rope(hf) -> dict:
    return dict(getattr(hf, "rope_parameters", None) or {**(hf.rope_scaling or {}), "rope_theta": hf.rope_theta})


def _inv_freq(hf) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf).model.rotary_emb.inv_freq


def test_the_llama_3_1_preset_is_the_8b_shape_with_128k_positions() -> None:
    hf = preset_config("llama-3.1-8b")
    rope = _rope(hf)
    assert hf.max_position_embeddings == 131072
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    assert model_shape(hf) == model_shape(preset_config("llama-3-8b"))
    assert type(build_on_meta(hf).model.rotary_emb).__name__ == "LlamaRotaryEmbedding"


def test_rope_scaling_over_a_preset_keeps_its_theta_and_scales_the_frequencies() -> None:
    plain = load_hf_config(load_config(TINY).model)
    scaled = load_hf_config(load_config(TINY, LINEAR).model)
    assert scaled.max_position_embeddings == 16384
    assert _rope(scaled) == {"rope_type": "linear", "factor": 4.0, "rope_theta": _rope(plain)["rope_theta"]}
    torch.testing.assert_close(_inv_freq(scaled), _inv_freq(plain) / 4.0)


def test_a_local_model_gets_the_positions_and_keeps_its_theta(tmp_path, cli) -> None:
    folder = tmp_path / "model"
    assert cli("init-model", str(folder), "--preset", "tiny-llama", "--config-only").returncode == 0
    theta = json.loads((folder / "config.json").read_text())
    theta = (theta.get("rope_parameters") or {}).get("rope_theta") or theta.get("rope_theta")
    llama3 = ("model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
              "original_max_position_embeddings: 4096}")
    cfg = load_config(TINY, [f"model.path={folder}", "model.preset=null", "model.max_position_embeddings=32768",
                             llama3])
    hf = load_hf_config(cfg.model)
    assert hf.max_position_embeddings == 32768
    assert _rope(hf)["rope_type"] == "llama3" and _rope(hf)["rope_theta"] == theta


def test_seq_len_past_the_positions_names_the_settings_that_raise_them(cli) -> None:
    refused = cli("validate", TINY, "train.seq_len=8192")
    assert refused.returncode == 2 and "model.max_position_embeddings=8192" in refused.stderr
    assert "model.rope_scaling" in refused.stderr and refused.stderr.count("\n") == 1
    assert cli("validate", TINY, "train.seq_len=8192", *LINEAR).returncode == 0


def test_rope_settings_transformers_cannot_use_are_one_line_errors(cli) -> None:
    for setting, fragment in (("{rope_type: nope, factor: 2.0}", "rope_type 'nope' is not one transformers has"),
                              ("{rope_type: llama3, factor: 2.0}", "transformers refuses")):
        proc = cli("validate", TINY, f"model.rope_scaling={setting}")
        assert proc.returncode == 2 and fragment in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
