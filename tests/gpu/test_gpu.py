"""GPU checks: run on the GPU machine; skipped cleanly without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, shardtune

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_bf16_training_on_all_gpus(tmp_path, strategy):
    out = tmp_path / strategy
    proc = shardtune("train", str(ROOT / "examples" / "tiny.yaml"), "--nproc", "auto", "--output-dir", str(out),
                     f"parallel.strategy={strategy}", "train.precision=bf16", "train.max_steps=20", "log.every=5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
    assert "x cuda" in proc.stderr
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["mfu"] is not None and steps[-1]["peak_mem_gib"] > 0
