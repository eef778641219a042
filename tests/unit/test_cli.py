"""The command line as users run it: exit codes, one-line errors, init-model, validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, shardtune

from shardtune.launch import LaunchOptions, resolve_nproc, torchrun_args

TINY = str(ROOT / "examples" / "tiny.yaml")


def _one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_validate_ok():
    proc = shardtune("validate", TINY)
    assert proc.returncode == 0, proc.stderr
    assert "validate: OK" in proc.stdout and "zero3" in proc.stdout


@pytest.mark.parametrize("override, fragments", [
    ("train.lerning_rate=1", ["train.lerning_rate", "did you mean"]),
    ("parallel.strategy=zero9", ["parallel.strategy", "zero9", "zero3"]),
    ("train.micro_batch_size=two", ["train.micro_batch_size", "'two'"]),
    ("data.train_file=/nope.jsonl", ["data.train_file", "/nope.jsonl"]),
    ("train.seq_len=100000", ["train.seq_len", "max_position_embeddings"]),
])
def test_bad_input_exits_2_with_one_line(override, fragments):
    _one_line_error(shardtune("validate", TINY, override), *fragments)


def test_train_refuses_bad_input_before_launching(tmp_path):
    proc = shardtune("train", TINY, "parallel.strategy=zero4", "--output-dir", str(tmp_path / "run"))
    _one_line_error(proc, "parallel.strategy")
    assert not (tmp_path / "run").exists()


def test_typo_in_yaml_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path(TINY).read_text().replace("micro_batch_size", "micro_batch"))
    _one_line_error(shardtune("validate", str(cfg)), "train.micro_batch", "micro_batch_size")


def test_missing_config_file():
    _one_line_error(shardtune("validate", "nope.yaml"), "nope.yaml", "does not exist")


def _model_dir(tmp_path: Path, hf_config) -> Path:
    path = tmp_path / hf_config.model_type
    hf_config.save_pretrained(path)
    return path


def test_encoder_decoder_model_is_refused(tmp_path):
    from transformers import T5Config

    path = _model_dir(tmp_path, T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=300))
    _one_line_error(shardtune("validate", TINY, "model.preset=null", f"model.path={path}"),
                    "'t5'", "encoder-decoder", "decoder-only")


def test_non_causal_architecture_is_refused(tmp_path):
    from transformers import ViTConfig

    path = _model_dir(tmp_path, ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    _one_line_error(shardtune("validate", TINY, "model.preset=null", f"model.path={path}"), "'vit'", "causal")


def test_model_dir_without_config(tmp_path):
    _one_line_error(shardtune("validate", TINY, "model.preset=null", f"model.path={tmp_path}"), "no config.json")


def test_init_model_tiny_loads_and_matches_preset_init(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.models.weights import RandomInitSource

    out = tmp_path / "tiny"
    proc = shardtune("init-model", str(out), "--preset", "tiny-llama", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= model.config.vocab_size
    source = RandomInitSource(model.config.initializer_range, seed=3)
    for name, param in model.named_parameters():
        assert torch.equal(param, source.full(name, param.shape)), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_init_model_config_only_for_real_shape(tmp_path):
    out = tmp_path / "8b"
    assert shardtune("init-model", str(out), "--preset", "llama-3-8b", "--config-only").returncode == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (4096, 32, 128256)
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()


def test_init_model_unknown_preset(tmp_path):
    _one_line_error(shardtune("init-model", str(tmp_path / "x"), "--preset", "gpt-9"), "gpt-9", "tiny-llama")


def test_resolve_nproc():
    assert resolve_nproc(3, "auto") == 3
    assert resolve_nproc(None, 2) == 2
    assert resolve_nproc("auto", 2) == (torch.cuda.device_count() or 1)


def test_torchrun_args_single_and_multi_node():
    single = torchrun_args(2, ["train", "c.yaml"], LaunchOptions())
    assert "--standalone" in single and "--nproc-per-node=2" in single
    assert single[-4:] == ["-m", "shardtune", "train", "c.yaml"]
    multi = torchrun_args(8, ["train", "c.yaml"], LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="h:29500"))
    assert "--standalone" not in multi
    for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-endpoint=h:29500", "--rdzv-backend=c10d"):
        assert flag in multi
