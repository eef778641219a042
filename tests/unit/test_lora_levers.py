"""LoRA levers of issue 17 that need no GPU to check. `peft.dropout: 0` (the default) puts no dropout in the
adapter path: PEFT builds nn.Identity for a dropout of 0 (peft/tuners/lora/layer.py, update_layer), so there
is nothing to remove on shardtune's side; this keeps it so, and checks that training-mode outputs are then
the eval-mode ones (no random mask)."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT

from shardtune.assemble import assemble
from shardtune.config import load_config
from shardtune.models.build import load_hf_config, restore_buffers

TINY = str(ROOT / "examples" / "tiny.yaml")


def _lora(dropout: float):
    cfg = load_config(TINY, ["peft.method=lora", f"peft.dropout={dropout}"])
    built = assemble(cfg.model, cfg.peft, "fp32", load_hf_config(cfg.model), torch.device("cpu"), 1)
    model = built.model.to_empty(device="cpu")
    restore_buffers(model, torch.device("cpu"))  # RoPE's inv_freq: `to_empty` leaves it uninitialised (CI got NaN)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)  # lora_B too, so the adapter path changes the output
    return model


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_no_dropout_module_when_lora_dropout_is_zero(dropout):
    model = _lora(dropout)
    adapted = [n for n, m in model.named_modules() if n.endswith("lora_A")]
    found = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    assert len(adapted) >= 7 and len(found) == (len(adapted) if dropout else 0), found[:3]


def test_with_dropout_zero_training_mode_gives_the_eval_outputs():
    model = _lora(0.0)
    ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        train = model.train()(input_ids=ids).logits
        evals = model.eval()(input_ids=ids).logits
    assert torch.isfinite(train).all()
    torch.testing.assert_close(train, evals, atol=0, rtol=0)
    model_drop = _lora(0.1)
    with torch.no_grad():
        assert not torch.equal(model_drop.train()(input_ids=ids).logits, model_drop.eval()(input_ids=ids).logits)


def test_an_adapter_of_a_preset_says_how_to_rebuild_its_base():
    """A preset has no folder: its name goes into adapter_config.json (nothing can load it), so the README beside
    the adapter gives the init-model command that writes the same weights, and how to load the pair."""
    from shardtune.config import ModelConfig
    from shardtune.peft.lora import adapter_base

    name, readme = adapter_base(ModelConfig(preset="tiny-llama", seed=3))
    assert name == "tiny-llama"
    assert "shardtune init-model BASE --preset tiny-llama --seed 3" in readme
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('BASE'), ADAPTER_DIR)" in readme


def test_an_adapter_of_a_preset_is_saved_without_looking_its_base_up():
    """PEFT's `save_embedding_layers="auto"` looks the base's config.json up to see whether the vocabulary was resized,
    on the Hub when the base is not a local folder (a preset's name): a network call at every adapter save, and a
    warning offline. shardtune never resizes the vocabulary, so only an adapted embedding is saved, and no lookup."""
    import warnings

    from shardtune.peft.lora import adapter_state

    model = _lora(0.0)
    model.peft_config["default"].base_model_name_or_path = "tiny-llama"  # what a preset's adapter records
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = adapter_state(model, 0, gather=lambda t: t)
    assert state and all("lora_" in k for k in state) and not any("embed_tokens" in k for k in state)


def test_building_a_lora_model_shows_no_library_deprecation_warning():
    """transformers 5.2x warns that `is_gradient_checkpointing` is deprecated when PEFT's get_peft_model reads it: a
    line in every LoRA run's output that its user can do nothing about (runtime.quiet_library_noise drops it)."""
    import warnings

    from shardtune.runtime import quiet_library_noise

    with warnings.catch_warnings(record=True) as caught:
        quiet_library_noise()
        _lora(0.0)
    assert not [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
