"""The command line as users run it: exit codes, one-line errors, init-model, validate.

Most tests call `shardtune.cli.main` in this process (the `cli` fixture): starting `python -m shardtune` costs
5-10 s of interpreter and torch import each. Two smoke tests run the real console command: one success, one
exit-2 error.
"""

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
    ("train.micro_batch_size=two", ["train.micro_batch_size", "'two'", "use an integer or 'auto'"]),
    # a union of bool and "auto": every choice named, the key alone (no branch name after it)
    ("parallel.checkpoint_in_compile=maybe", ["parallel.checkpoint_in_compile: 'maybe'", "use true, false or 'auto'"]),
    ("data.train_file=/nope.jsonl", ["data.train_file", "/nope.jsonl"]),
    ("train.seq_len=100000", ["train.seq_len", "max_position_embeddings"]),
])
def test_bad_input_exits_2_with_one_line(override, fragments, cli):
    _one_line_error(cli("validate", TINY, override), *fragments)


def test_train_refuses_bad_input_before_launching(tmp_path):
    proc = shardtune("train", TINY, "parallel.strategy=zero4", "--output-dir", str(tmp_path / "run"))
    _one_line_error(proc, "parallel.strategy")
    assert not (tmp_path / "run").exists()


def test_typo_in_yaml_file(tmp_path, cli):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path(TINY).read_text().replace("micro_batch_size", "micro_batch"))
    _one_line_error(cli("validate", str(cfg)), "train.micro_batch", "micro_batch_size")


def test_missing_config_file(cli):
    _one_line_error(cli("validate", "nope.yaml"), "nope.yaml", "does not exist")


def _model_dir(tmp_path: Path, hf_config) -> Path:
    path = tmp_path / hf_config.model_type
    hf_config.save_pretrained(path)
    return path


def test_encoder_decoder_model_is_refused(tmp_path, cli):
    from transformers import T5Config

    path = _model_dir(tmp_path, T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=300))
    _one_line_error(cli("validate", TINY, "model.preset=null", f"model.path={path}"),
                    "'t5'", "encoder-decoder", "decoder-only")


def test_non_causal_architecture_is_refused(tmp_path, cli):
    from transformers import ViTConfig

    path = _model_dir(tmp_path, ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    _one_line_error(cli("validate", TINY, "model.preset=null", f"model.path={path}"), "'vit'", "causal")


def test_model_dir_without_config(tmp_path, cli):
    _one_line_error(cli("validate", TINY, "model.preset=null", f"model.path={tmp_path}"), "no config.json")


def test_init_model_tiny_loads_and_matches_preset_init(tmp_path, cli):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.models.weights import RandomInitSource

    out = tmp_path / "tiny"
    proc = cli("init-model", str(out), "--preset", "tiny-llama", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= model.config.vocab_size
    source = RandomInitSource(model.config.initializer_range, seed=3)
    for name, param in model.named_parameters():
        assert torch.equal(param, source.full(name, param.shape)), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_init_model_config_only_for_real_shape(tmp_path, cli):
    out = tmp_path / "8b"
    assert cli("init-model", str(out), "--preset", "llama-3-8b", "--config-only").returncode == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (4096, 32, 128256)
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()


def test_init_model_unknown_preset(tmp_path, cli):
    _one_line_error(cli("init-model", str(tmp_path / "x"), "--preset", "gpt-9"), "gpt-9", "tiny-llama")


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


# --- shardtune plan ----------------------------------------------------------------------------------------------


def test_plan_summary(cli):
    proc = cli("plan", TINY)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for fragment in ("backend    fsdp2", "zero3: FSDP2", "LlamaDecoderLayer", "offload    none", "fp32",
                     "2 per node", "32 sequences x 24 tokens"):
        assert fragment in out, out


def test_plan_summary_names_the_activation_memory_budget(cli):
    proc = cli("plan", TINY, "parallel.compile=true", "parallel.activation_memory_budget=0.5")
    assert proc.returncode == 0, proc.stderr
    assert "activation checkpointing none, compile, activation memory budget 0.5" in proc.stdout, proc.stdout
    assert " b0.5 " in proc.stdout  # the candidates without checkpointing run under it, and the table says so


def test_plan_summary_deepspeed(cli):
    proc = cli("plan", TINY, "parallel.backend=deepspeed", "parallel.strategy=zero2",
                     "parallel.offload=optimizer", "train.grad_accum=2", "--nproc", "4")
    assert proc.returncode == 0, proc.stderr
    for fragment in ("backend    deepspeed", "DeepSpeed ZeRO stage 2", "optimizer states to CPU memory",
                     "4 per node", "128 sequences"):
        assert fragment in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, fragments", [
    (["--emit", "json"], ["--emit 'json'", "deepspeed, accelerate"]),
    (["--emit", "deepspeed"], ["--emit deepspeed", "parallel.backend=deepspeed"]),
    (["parallel.strategy=zero1"], ["parallel.strategy: zero1", "parallel.backend=deepspeed"]),
    (["parallel.backend=deepspeed", "deepspeed.zero_optimization.stage=2", "--emit", "deepspeed"],
     ["deepspeed.zero_optimization.stage: 2 conflicts with parallel.strategy=zero3"]),
    (["parallel.backend=deepspeed", "deepspeed.optimizer={type: Adam}"], ["deepspeed.optimizer", "optim."]),
])
def test_plan_bad_input_exits_2_with_one_line(args, fragments, cli):
    proc = cli("plan", TINY, *args)
    _one_line_error(proc, *fragments)
    assert proc.stdout == ""


def test_a_misspelt_deepspeed_key_is_refused_by_validate_and_named_by_plan(cli):
    """`plan` leaves `import deepspeed` out (seconds of a command meant for a login node) and says that the
    `deepspeed:` section goes through DeepSpeed's parser in `validate` (and at launch), which refuses it."""
    args = ["parallel.backend=deepspeed", "deepspeed.zero_optimization.reduce_bucket_sise=5"]
    planned = cli("plan", TINY, *args, "--gpu", "h100")
    assert planned.returncode == 0 and "deepspeed: section is checked by DeepSpeed's own parser" in planned.stderr
    _one_line_error(cli("validate", TINY, *args), "DeepSpeed refuses", "reduce_bucket_sise")


@pytest.fixture
def single_process_trainer_env(monkeypatch):
    """TrainingArguments(deepspeed=...) in this process: one process, no launcher variables; no global DeepSpeed
    state (transformers' is_deepspeed_zero3_enabled weakref, accelerate's shared state) left for other tests."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(var, raising=False)
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


def _training_args(tmp_path, ds, **kwargs):
    from transformers import TrainingArguments

    # __post_init__ runs HfTrainerDeepSpeedConfig.trainer_config_process (fills "auto" from these arguments);
    # Trainer runs trainer_config_finalize when training starts: that is where mismatches are reported.
    args = TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=ds, report_to="none", **kwargs)
    args.hf_deepspeed_config.trainer_config_finalize(args, None, 300)
    return args


@pytest.mark.parametrize("overrides", [
    ["parallel.strategy=zero3"],
    ["parallel.strategy=zero2", "parallel.offload=optimizer", "train.precision=bf16", "train.grad_accum=3",
     "optim.min_lr_ratio=0.1", "optim.max_grad_norm=0.5"],
    ["parallel.strategy=zero3", "parallel.offload=params", "train.precision=fp16", "train.micro_batch_size=2",
     "parallel.activation_checkpointing=full", "deepspeed.zero_optimization.sub_group_size=1e8"],
])
def test_emit_deepspeed_is_accepted_by_training_arguments(tmp_path, single_process_trainer_env, overrides, cli):
    from deepspeed.runtime.config import DeepSpeedConfig

    from shardtune.config import load_config
    from shardtune.parallel.ds_config import trainer_arguments

    overrides = ["parallel.backend=deepspeed", *overrides]
    proc = cli("plan", TINY, *overrides, "--emit", "deepspeed")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "ds.json"
    path.write_text(proc.stdout)
    emitted = json.loads(path.read_text())  # stdout holds the JSON and nothing else
    assert "TrainingArguments(" in proc.stderr
    cfg = load_config(TINY, overrides)
    kwargs = trainer_arguments(cfg.parallel, cfg.train, cfg.optim)
    args = _training_args(tmp_path, str(path), use_cpu=cfg.train.precision == "bf16", **kwargs)
    filled = args.hf_deepspeed_config.config
    assert filled["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch_size
    assert filled["gradient_accumulation_steps"] == cfg.train.grad_accum
    assert filled["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum * args.world_size
    assert filled["gradient_clipping"] == cfg.optim.max_grad_norm
    assert filled["bf16"]["enabled"] == (cfg.train.precision == "bf16")
    assert filled["fp16"]["enabled"] == (cfg.train.precision == "fp16")
    assert filled["zero_optimization"]["stage"] == emitted["zero_optimization"]["stage"]
    assert "auto" not in json.dumps(filled)  # Trainer filled every placeholder
    parsed = DeepSpeedConfig(filled)  # and DeepSpeed takes the result
    assert parsed.zero_optimization_stage == emitted["zero_optimization"]["stage"]
    if cfg.parallel.offload == "none":  # Trainer builds torch AdamW (no decay on norms and biases, as shardtune)
        assert "optimizer" not in emitted
    else:  # the host-side step: DeepSpeed's AdamW (DeepSpeedCPUAdam), with Trainer's values
        assert filled["optimizer"] == {"type": "AdamW", "params": {
            "lr": cfg.train.lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
            "weight_decay": cfg.optim.weight_decay}}
        assert parsed.optimizer_name == "adamw"
    # "auto", not shardtune's numbers: TrainingArguments that differ from the shardtune config are accepted too.
    other = _training_args(tmp_path, str(path), use_cpu=cfg.train.precision == "bf16",
                           **{**kwargs, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 5,
                              "max_grad_norm": 0.25})
    filled = other.hf_deepspeed_config.config
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["train_batch_size"], filled["gradient_clipping"]) == (3, 5, 15, 0.25)


def test_mismatching_deepspeed_config_is_refused_by_training_arguments(tmp_path, single_process_trainer_env):
    # Negative control: a hand-written config that says fp16 while TrainingArguments does not.
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="mismatch TrainingArguments values"):
        _training_args(tmp_path, ds, per_device_train_batch_size=16)


def _accelerate_launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file PATH train.py` reads from the file and hands its workers."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    known = set(vars(args))
    args, defaults, _ = _validate_launch_command(args)
    for section in ("deepspeed_config", "fsdp_config"):
        for key in getattr(defaults, section):  # accelerate copies unknown keys without a word: none may be unknown
            assert key in known, f"{section}.{key} is no accelerate launch argument"
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return loaded, prepare_deepspeed_cmd_env(args)[1]
    return loaded, prepare_multi_gpu_env(args)


def test_emit_accelerate_deepspeed_loads_in_accelerate(tmp_path, monkeypatch, single_process_trainer_env, cli):
    proc = cli("plan", TINY, "parallel.backend=deepspeed", "parallel.strategy=zero3", "parallel.offload=params",
                     "train.precision=bf16", "train.grad_accum=2", "--emit", "accelerate")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "accelerate.yaml"
    path.write_text(proc.stdout)
    loaded, env = _accelerate_launch_env(path)
    assert loaded.distributed_type == "DEEPSPEED" and loaded.num_processes == 2 and loaded.mixed_precision == "bf16"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # built from the launcher's environment, as in each worker
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 2
    assert plugin.deepspeed_config["gradient_clipping"] == 1.0
    assert plugin.zero3_init_flag is True


def test_emit_accelerate_fsdp2_loads_in_accelerate(tmp_path, monkeypatch, single_process_trainer_env, cli):
    proc = cli("plan", TINY, "parallel.strategy=zero2", "parallel.activation_checkpointing=full",
                     "--emit", "accelerate")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "accelerate.yaml"
    path.write_text(proc.stdout)
    loaded, env = _accelerate_launch_env(path)
    assert loaded.distributed_type == "FSDP" and loaded.mixed_precision == "no"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing is True
    assert str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT")


def test_emit_accelerate_hsdp_loads_in_accelerate(tmp_path, monkeypatch, single_process_trainer_env, cli):
    proc = cli("plan", TINY, "parallel.strategy=hsdp", "parallel.shard_size=2", "--nproc", "4",
                     "--emit", "accelerate")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "accelerate.yaml"
    path.write_text(proc.stdout)
    loaded, env = _accelerate_launch_env(path)
    assert loaded.distributed_type == "FSDP" and loaded.num_processes == 4
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.parallelism_config import ParallelismConfig

    mesh = ParallelismConfig()  # from the launcher's environment, as in each worker
    assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (2, 2)


def test_plan_hsdp_shard_size_must_divide_the_processes(cli):
    proc = cli("plan", TINY, "parallel.strategy=hsdp", "parallel.shard_size=3", "--nproc", "4")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "parallel.shard_size: 3 does not divide the 4 processes" in proc.stderr


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_hsdp_group_may_span_nodes(cli, command):
    """parallel.shard_size divides the job's processes (2 nodes x 2 = 4), not one node's 2."""
    proc = cli(command, TINY, "parallel.strategy=hsdp", "parallel.shard_size=4", "--nproc", "2", "--nnodes", "2")
    assert proc.returncode == 0, proc.stderr
    if command == "plan":
        assert "(replicate 1, shard 4) mesh" in proc.stdout and "2 per node x 2 nodes" in proc.stdout, proc.stdout
        assert "x 4 processes)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_hsdp_group_that_divides_neither_count_is_one_line(cli, command):
    _one_line_error(cli(command, TINY, "parallel.strategy=hsdp", "parallel.shard_size=3", "--nproc", "2", "--nnodes",
                        "2"), "parallel.shard_size: 3 does not divide the 4 processes", "choose a divisor of 4")


def test_plan_hsdp_auto_group_is_one_node(cli):
    proc = cli("plan", TINY, "parallel.strategy=hsdp", "--nproc", "2", "--nnodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert "(replicate 2, shard 2) mesh" in proc.stdout, proc.stdout


@pytest.mark.parametrize("command, method", [("train", "lora"), ("validate", "qlora")])
def test_missing_peft_is_caught_before_any_process_starts(tmp_path, command, method):
    """peft made unimportable for the whole process (a sitecustomize shim, as if it were not installed)."""
    import os
    import subprocess
    import sys

    from conftest import _env

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None  # `import peft` fails\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shardtune", command, TINY, f"peft.method={method}",
                           f"train.output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    _one_line_error(proc, f"peft.method: {method} needs the peft package", "pip install -e '.[peft]'")
    assert not out.exists()


def test_install_hints_name_commands_that_work_from_a_checkout():
    """shardtune is not on a package index: `pip install 'shardtune[...]'` would fail or fetch something else."""
    sources = [p for p in (ROOT / "src" / "shardtune").rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in sources if "shardtune[" in p.read_text()]
    assert sources and offenders == []



def test_the_api_function_survives_an_import_of_the_train_subpackage():
    """`import shardtune.train.loop` binds shardtune.train to the subpackage: it must still be the API call."""
    import inspect

    import shardtune
    import shardtune.train.loop
    from shardtune.errors import ShardtuneError

    assert callable(shardtune.train)
    with pytest.raises(ShardtuneError, match="zero4"):  # the API's own check, before any process starts
        shardtune.train(TINY, ["parallel.strategy=zero4"])
    assert inspect.signature(shardtune.api.train).parameters.keys() >= {"overrides", "nproc", "output_dir"}


def test_emit_accelerate_without_a_gpu_says_use_cpu_and_that_fsdp_needs_gpus(cli):
    """use_cpu: false on a machine without GPUs made accelerate fall back, silently, to unsharded training."""
    import torch
    import yaml

    if torch.cuda.is_available():
        pytest.skip("checks a machine without GPUs")
    proc = cli("plan", TINY, "parallel.strategy=zero3", "--emit", "accelerate")
    assert proc.returncode == 0, proc.stderr
    out = yaml.safe_load(proc.stdout)
    assert out["use_cpu"] is True and "gpu_ids" not in out and out["distributed_type"] == "FSDP"
    note = [line for line in proc.stderr.splitlines() if "use_cpu" in line]
    assert len(note) == 1 and "accelerate's FSDP and DeepSpeed need GPUs" in note[0] and "--gpu TYPE" in note[0]
    ddp = cli("plan", TINY, "parallel.strategy=ddp", "--emit", "accelerate")
    assert yaml.safe_load(ddp.stdout)["distributed_type"] == "MULTI_CPU" and "need GPUs" not in ddp.stderr
    for_gpus = cli("plan", TINY, "parallel.strategy=zero3", "--emit", "accelerate", "--gpu", "h100")
    out = yaml.safe_load(for_gpus.stdout)
    assert out["use_cpu"] is False and out["gpu_ids"] == "all" and "use_cpu" not in for_gpus.stderr


def test_every_option_and_argument_of_every_command_has_help():
    """`shardtune validate --help` listed its arguments with no word on them; this catches the next one too."""
    import argparse

    from shardtune.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) >= 8
    bare = [f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
            for name, sub in commands.items() for action in sub._actions
            if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert bare == []


def test_a_closed_pipe_ends_plan_quietly():
    """`shardtune plan CFG | head -1`: the reader has gone when plan writes; no traceback, SIGPIPE's exit code."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "shardtune", "plan", TINY, "--gpu", "h100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before plan has written anything: its writes meet a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
