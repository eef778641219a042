"""The GPU benchmarks' shardtune variants load and pass the pre-launch checks here, so a device call (ten minutes
at most, thirty a session) never spends its time on an override the config refuses."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from conftest import ROOT

from shardtune.config import load_config
from shardtune.parallel import check_combination


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LONG_CONTEXT = _bench("long_context")


@pytest.mark.parametrize("variant", sorted(LONG_CONTEXT.VARIANTS))
def test_each_long_context_variant_passes_the_checks_a_run_makes(variant: str) -> None:
    overrides = LONG_CONTEXT.run_overrides(variant, 262144, "llama-3.1-8b", 131072,
                                           ROOT / "examples" / "data" / "tasks.jsonl", 3)
    cfg = load_config(str(ROOT / "bench" / "bench.yaml"), overrides)
    assert cfg.model.max_position_embeddings == 262144 and cfg.peft.method == "qlora"
    check_combination(cfg, 1)


PARITY_1B = _bench("parity_1b")


@pytest.mark.parametrize("set_name, variant", sorted((s, v) for s, variants in PARITY_1B.VARIANTS.items()
                                                     for v in variants))
def test_each_parity_1b_variant_passes_the_checks_a_run_makes(set_name: str, variant: str, tmp_path) -> None:
    args = argparse.Namespace(preset="llama-3.2-1b", precision="bf16", seq=2048, mbs=4, steps=50)
    overrides = PARITY_1B.run_overrides(args, ROOT / "examples" / "data" / "tasks.jsonl", tmp_path,
                                        PARITY_1B.REFERENCE[set_name] + PARITY_1B.VARIANTS[set_name][variant])
    cfg = load_config(str(ROOT / "bench" / "bench.yaml"), overrides)
    assert cfg.train.micro_batch_size == 4
    check_combination(cfg, 1)
