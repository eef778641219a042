"""What a resume restores besides the weights: each rank's RNG (dropout draws), the global batch (refused when
the new process count cannot keep it), and the adapter a LoRA run saves (never an empty one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardtune.checkpoint.checkpointer import _load_rng, _save_rng
from shardtune.config import PeftConfig, config_from_dict
from shardtune.dist import DistContext
from shardtune.errors import ShardtuneError
from shardtune.train.loop import keep_global_batch

CPU = torch.device("cpu")


def _draws() -> tuple[torch.Tensor, torch.Tensor]:
    """The next random numbers, and a LoRA-style dropout mask (what a resumed step draws first)."""
    return torch.rand(8), torch.nn.functional.dropout(torch.ones(256), p=0.1, training=True)


def test_rng_round_trip_gives_the_same_next_draws(tmp_path: Path) -> None:
    torch.manual_seed(3)
    torch.rand(5)  # somewhere mid-run, not at a seed
    path = tmp_path / "rank0.safetensors"
    _save_rng(path, CPU)
    expected = _draws()
    torch.manual_seed(99)  # what the resumed process does first (set_up seeds with train.seed)
    other = _draws()
    assert not torch.equal(other[1], expected[1])  # so the comparison below can fail
    _load_rng(path, CPU)
    for got, want in zip(_draws(), expected, strict=True):
        assert torch.equal(got, want)


def _cfg(micro: int, accum: int):
    return config_from_dict({"model": {"preset": "tiny-llama"}, "data": {"train_file": "x.jsonl"},
                             "train": {"micro_batch_size": micro, "grad_accum": accum}})


def _ctx(world: int) -> DistContext:
    return DistContext(rank=0, world=world, local_rank=0, device=CPU)


def test_resume_on_another_world_size_keeps_the_global_batch() -> None:
    cfg = keep_global_batch(_cfg(4, 2), {"global_batch": 16}, _ctx(1))
    assert cfg.train.grad_accum == 4  # 1 x 4 x 4 = the checkpoint's 16
    same = _cfg(4, 2)
    assert keep_global_batch(same, {"global_batch": 16}, _ctx(2)) is same


def test_resume_refuses_a_world_size_that_cannot_keep_the_global_batch() -> None:
    with pytest.raises(ShardtuneError) as err:
        keep_global_batch(_cfg(4, 2), {"global_batch": 16}, _ctx(3))  # 3 x 4 = 12 does not divide 16
    msg = str(err.value)
    assert "16 sequences per step" in msg and "3 processes" in msg and "micro_batch_size=4" in msg
    assert "micro_batch_size * grad_accum * processes = 16" in msg and "\n" not in msg


@pytest.fixture(scope="module")
def lora_model() -> torch.nn.Module:
    from shardtune.models.build import build_on_meta
    from shardtune.models.presets import preset_config
    from shardtune.peft.lora import apply_lora

    model = apply_lora(build_on_meta(preset_config("tiny-llama")), PeftConfig(r=8, alpha=16), "llama")
    return model.to_empty(device=CPU)


def test_an_adapter_that_gathers_empty_is_refused(tmp_path: Path, lora_model: torch.nn.Module) -> None:
    # ZeRO-3 leaves a parameter's local tensor empty outside a gather: saving that would write an adapter
    # with no weights (peft #2892), which loads silently as the base model.
    from shardtune.checkpoint.hf_export import save_adapter

    out = tmp_path / "adapter"
    with pytest.raises(RuntimeError, match="adapter state is empty"):
        save_adapter(lora_model, out, "base", None, 0, gather=lambda p: p.detach()[:0])
    assert not out.exists()
    save_adapter(lora_model, out, "base", None, 0, gather=lambda p: p.detach())  # the same model, gathered
    assert (out / "adapter_model.safetensors").is_file()
