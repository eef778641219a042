"""A model folder's Python code never runs unless model.trust_remote_code: true. Each folder here ships code
that creates a file when imported; the file must not exist after shardtune has looked at the folder, even
when stdin answers "y" to transformers' "Do you wish to run the custom code?"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, _env, one_line_error

from shardtune.config import ModelConfig
from shardtune.errors import ShardtuneError
from shardtune.models.build import load_hf_config
from shardtune.models.tokenizer import bundled_tokenizer_dir, load_tokenizer

TINY = str(ROOT / "examples" / "tiny.yaml")
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 128}


def _model_dir(tmp_path: Path, model_type: str, *, custom_tokenizer: bool = False) -> tuple[Path, Path]:
    """A model folder whose config (and with custom_tokenizer, tokenizer) code touches `ran` on import."""
    folder, ran = tmp_path / f"model-{model_type}", tmp_path / "custom-code-ran"
    folder.mkdir()
    for f in bundled_tokenizer_dir().iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    touch = f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
    (folder / "configuration_custom.py").write_text(
        touch + "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n"
                f"    model_type = {model_type!r}\n")
    (folder / "modeling_custom.py").write_text(
        touch + "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
                "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig",
                "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "auto_map": auto_map, **SHAPE}))
    if custom_tokenizer:
        (folder / "tokenization_custom.py").write_text(
            touch + "from transformers import PreTrainedTokenizerFast\n\n\n"
                    "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="CustomTokenizer",
                      auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, ran


def _answering_yes(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, with "y" waiting on stdin for any prompt (and transformers' module
    cache in tmp_path, so nothing it might write outlives the test)."""
    env = _env() | {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=ROOT, env=env, input="y\n",
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_custom_model_type_is_refused_and_its_code_never_runs(tmp_path, command):
    folder, ran = _model_dir(tmp_path, "custom_llm")
    proc = _answering_yes(tmp_path, command, TINY, "model.preset=null", f"model.path={folder}",
                          f"train.output_dir={tmp_path / 'run'}")
    one_line_error(proc, "model.path", "auto_map", "'custom_llm'", "model.trust_remote_code=true")
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    assert not ran.exists()
    assert not (tmp_path / "run").exists()


def test_custom_code_of_a_known_model_type_is_ignored_with_a_warning(tmp_path):
    folder, ran = _model_dir(tmp_path, "llama")
    proc = _answering_yes(tmp_path, "plan", TINY, "model.preset=null", f"model.path={folder}")
    assert proc.returncode == 0, proc.stderr
    assert "custom code" in proc.stderr and "ignored" in proc.stderr and "LlamaDecoderLayer" in proc.stdout
    assert not ran.exists()
    hf_config = load_hf_config(ModelConfig(path=str(folder)))
    assert type(hf_config).__name__ == "LlamaConfig" and not ran.exists()


def test_a_tokenizer_that_needs_its_own_code_is_refused(tmp_path):
    folder, ran = _model_dir(tmp_path, "llama", custom_tokenizer=True)
    with pytest.raises(ShardtuneError, match=r"tokenizer .* needs its own Python code"):
        load_tokenizer(str(folder))
    assert not ran.exists()


def test_trust_remote_code_true_is_the_way_to_run_it(tmp_path):
    folder, ran = _model_dir(tmp_path, "custom_llm")
    proc = _answering_yes(tmp_path, "plan", TINY, "model.preset=null", f"model.path={folder}",
                          "model.trust_remote_code=true")
    assert proc.returncode == 0, proc.stderr
    assert ran.exists()  # the folder's code ran: the user asked for it
    assert "custom_llm" in proc.stdout and "LlamaDecoderLayer" in proc.stdout


def test_trust_remote_code_is_documented_with_its_risk():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `model.trust_remote_code`"))
    assert "| false |" in row and "your permissions" in row
