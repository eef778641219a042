"""The final HF export in one process: sharded files, index, atomic replacement."""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.checkpoint import hf_export
from shardtune.checkpoint.hf_export import save_hf_model
from shardtune.fileio import plan_shards
from shardtune.models.build import build_on_meta
from shardtune.models.presets import preset_config
from shardtune.models.tokenizer import load_tokenizer
from shardtune.models.weights import RandomInitSource, load_weights


@pytest.fixture
def tiny():
    cfg = preset_config("tiny-llama")
    model = build_on_meta(cfg)
    load_weights(model, RandomInitSource(0.02, seed=0), torch.device("cpu"))
    return model, cfg, load_tokenizer(None)


def test_plan_shards():
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]


def test_sharded_export_round_trips(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    model, cfg, tok = tiny
    save_hf_model(model, cfg, tok, tmp_path / "m", dtype=torch.float32, max_shard_bytes=3_000_000, rank=0)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once, as transformers does
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.arange(4, 20).view(1, -1)
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_failed_save_leaves_previous_model_intact(tmp_path, tiny, monkeypatch):
    model, cfg, tok = tiny
    out = tmp_path / "m"
    save_hf_model(model, cfg, tok, out, dtype=torch.bfloat16, max_shard_bytes=10**9, rank=0)
    before = (out / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "write_config", crash)
    with pytest.raises(OSError):
        save_hf_model(model, cfg, tok, out, dtype=torch.float32, max_shard_bytes=10**9, rank=0)
    assert (out / "model.safetensors").read_bytes() == before
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
