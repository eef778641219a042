"""`shardtune export` runs in bounded memory (README: "reads one tensor at a time from the shards and writes
safetensors files as it goes"): the host memory it takes does not grow with the model.

Measured, not inferred: the process's peak resident memory (Linux VmHWM, reset through /proc/self/clear_refs) above
its resident memory when the export starts, for two checkpoints of the same shape but 2 and 10 decoder blocks
(~37 MB and ~165 MB of fp32 tensors). A bounded export peaks at about the same height for both (one tensor, one
output shard, the checksum pass's read buffers); one that holds the state dict, or one output shard of everything,
peaks 128 MB or more higher for the bigger one. The small export runs first and also warms up what the first export
imports and caches."""

from __future__ import annotations

import ctypes
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoConfig

from shardtune.checkpoint.export import export_checkpoint
from shardtune.checkpoint.layout import TRAINER_STATE, finalize
from shardtune.models.build import build_on_meta
from shardtune.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads peak memory from /proc (Linux)")
MB = 1 << 20
# Every decoder block holds 16 MB of fp32 tensors (4 x 1 MB attention, 3 x 4 MB MLP); embeddings 2 x 2 MB.
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
             tie_word_embeddings=False)
MAX_SHARD = 8 * MB  # bf16 output: four MLP matrices per file


def _write_checkpoint(path: Path, layers: int) -> tuple[Path, int]:
    """A complete DCP checkpoint of a Llama shape with `layers` blocks (tensor i filled with i), as the DCP format
    lays it out; returns it and its model bytes."""
    cfg = AutoConfig.for_model("llama", num_hidden_layers=layers, **SHAPE)
    shapes = {name: p.shape for name, p in build_on_meta(cfg).named_parameters()}
    state = {"model": {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(shapes.items())}}
    tmp, final = path / ".tmp-step-00000001", path / "step-00000001"
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp / "hf")
    load_tokenizer(None).save_pretrained(tmp / "hf")
    (tmp / TRAINER_STATE).write_text(json.dumps({"step": 1, "config": {"train": {"precision": "fp32"}}}))
    finalize(tmp, final, {"format": "dcp"})
    return final, sum(t.numel() * 4 for t in state["model"].values())


def _status_kb(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def _peak_growth(checkpoint: Path, out: Path) -> int:
    """Bytes of resident memory the export took at its peak, above what the process held when it started."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the export cannot hide in it
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = _status_kb("VmRSS")
    export_checkpoint(str(checkpoint), out, dtype="bf16", max_shard_bytes=MAX_SHARD)
    return (_status_kb("VmHWM") - start) * 1024


def test_export_memory_does_not_grow_with_the_model(tmp_path):
    try:
        small, small_bytes = _write_checkpoint(tmp_path / "small", 2)
        big, big_bytes = _write_checkpoint(tmp_path / "big", 10)
        assert big_bytes - small_bytes > 8 * 16 * MB  # (+ the norm weights)
        small_peak = _peak_growth(small, tmp_path / "small-hf")
        big_peak = _peak_growth(big, tmp_path / "big-hf")
        # 8 more blocks (128 MB of fp32 tensors) raise the peak by ~10-25 MB (allocator fragmentation, measured);
        # holding them would raise it by 128 MB or more.
        assert big_peak - small_peak < (big_bytes - small_bytes) / 2, (small_peak / MB, big_peak / MB)
        # The export is whole: one tensor read back where the checkpoint put it (bf16 of its fill value).
        index = json.loads((tmp_path / "big-hf" / "model.safetensors.index.json").read_text())["weight_map"]
        name = "model.layers.9.mlp.down_proj.weight"
        assert len(index) == 3 + 9 * 10 and len(set(index.values())) > 10
        with safe_open(tmp_path / "big-hf" / index[name], framework="pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == torch.bfloat16 and t.shape == (512, 2048) and float(t[0, 0]) == 1 + 9 * 9 + 6
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # ~400 MB of files
