"""Config loading, validation errors and dotted overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardtune.config import ConfigError, config_from_dict, dump_config, load_config, parse_overrides, parse_size

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "examples/data/tasks.jsonl"}}


def test_examples_load_and_pass_the_combination_checks():
    from shardtune.validate import check_combination

    names = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    assert {"tiny.yaml", "llama-1b.yaml", "llama-8b-deepspeed-offload.yaml"} <= set(names)
    for name in names:
        cfg = load_config(ROOT / "examples" / name)
        assert cfg.train.seq_len > 0
        check_combination(cfg, world=2)  # the DeepSpeed example's config is built and parsed by DeepSpeed too


def test_defaults_and_names_users_rely_on():
    cfg = config_from_dict(BASE)
    assert cfg.parallel.strategy == "zero3"
    assert cfg.train.precision == "bf16"
    assert cfg.model.path is None and cfg.model.preset == "tiny-llama"
    for key in ("max_steps", "epochs", "micro_batch_size", "grad_accum", "seq_len", "lr", "precision"):
        assert key in type(cfg.train).model_fields


def test_overrides_apply_and_parse_types():
    cfg = config_from_dict(BASE, ["train.lr=1e-4", "parallel.strategy=zero2", "train.max_steps=7",
                                  "optim.betas=[0.9, 0.95]", "parallel.compile=true"])
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.parallel.strategy == "zero2"
    assert cfg.train.max_steps == 7
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.parallel.compile is True


def test_parse_overrides_shape():
    assert parse_overrides(["train.seq_len=64", "model.path=/x"]) == {"train": {"seq_len": 64}, "model": {"path": "/x"}}


@pytest.mark.parametrize("item, fragment", [
    ("train.lr", "expected section.key=value"),
    ("lr=1e-4", "expected section.key=value"),
    ("trian.lr=1", "did you mean 'train'"),
    ("train.a.b=1", "expected section.key=value"),
])
def test_bad_override_syntax(item, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_overrides([item])


@pytest.mark.parametrize("override, fragments", [
    ("train.learning_rate=1", ["train.learning_rate", "unknown key", "did you mean 'lr'"]),
    ("train.micro_batchsize=2", ["did you mean 'micro_batch_size'"]),
    ("parallel.strategy=zero4", ["parallel.strategy", "'zero4'", "ddp", "zero3"]),
    ("train.precision=fp4", ["train.precision", "bf16"]),
    ("train.lr=abc", ["train.lr", "'abc'", "number"]),
    ("train.lr=-1", ["train.lr", "greater than 0"]),
    ("train.max_steps=0", ["train.max_steps", "greater than or equal to 1"]),
    ("parallel.nproc=0", ["parallel.nproc", ">= 1 or 'auto'"]),
    ("checkpoint.max_shard_size=lots", ["checkpoint.max_shard_size", "5GB"]),
    ("model.preset=gpt-9", ["model.preset", "'gpt-9'", "tiny-llama"]),
])
def test_bad_values_name_key_value_and_allowed(override, fragments):
    with pytest.raises(ConfigError) as info:
        config_from_dict(BASE, [override])
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_unknown_section_and_missing_sections():
    with pytest.raises(ConfigError, match=r"unknown key.*did you mean 'parallel'"):
        config_from_dict({**BASE, "paralel": {"strategy": "ddp"}})
    with pytest.raises(ConfigError, match="data: required key is missing"):
        config_from_dict({"model": {"preset": "tiny-llama"}})


def test_model_path_xor_preset():
    with pytest.raises(ConfigError, match=r"exactly one of model\.path"):
        config_from_dict({**BASE, "model": {"preset": "tiny-llama", "path": "/x"}})
    with pytest.raises(ConfigError, match=r"exactly one of model\.path"):
        config_from_dict({**BASE, "model": {}})


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("model: 3\ndata: {train_file: x}\n")
    with pytest.raises(ConfigError, match="model: must be a mapping"):
        load_config(scalar)


@pytest.mark.parametrize("text, key, lines", [
    # a second section of the same name, far below the first
    ("model: {preset: tiny-llama}\ntrain:\n  lr: 1.0e-3\ndata: {train_file: x}\n\ntrain:\n  max_steps: 3\n",
     "train", (2, 6)),
    # the same key twice in one section
    ("model: {preset: tiny-llama}\ndata: {train_file: x}\ntrain:\n  lr: 1.0e-3\n  max_steps: 3\n  lr: 1.0e-4\n",
     "train.lr", (4, 6)),
    # inside a list of sources, and in a flow mapping
    ("model: {preset: tiny-llama}\ndata:\n  sources:\n    - {path: a.jsonl, weight: 1, weight: 2}\n",
     "data.sources[0].weight", (4, 4)),
    # in the free-form deepspeed section
    ("model: {preset: tiny-llama}\ndata: {train_file: x}\ndeepspeed:\n  zero_optimization:\n"
     "    stage: 3\n    stage: 2\n", "deepspeed.zero_optimization.stage", (5, 6)),
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, key, lines):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f"{key} is given twice (line {lines[0]} and line {lines[1]})" in message and "\n" not in message


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    text = ("model: {preset: tiny-llama}\ndata: {train_file: x}\n"
            "train:\n  <<: {lr: 1.0e-3, max_steps: 3}\n  lr: 1.0e-4\n"
            "optim: {betas: [0.9, 0.95]}\n")
    path.write_text(text)
    cfg = load_config(path)
    assert cfg.train.lr == pytest.approx(1e-4) and cfg.train.max_steps == 3


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_an_empty_config_file_says_so(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml' is empty; it needs at least a model and a data section"):
        load_config(path)


def test_dump_round_trips(tmp_path):
    cfg = config_from_dict(BASE, ["train.lr=0.001", "optim.betas=[0.8, 0.9]", f"train.output_dir={tmp_path / 'run'}",
                                  f"data.train_file={ROOT / 'examples' / 'data' / 'tasks.jsonl'}"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 0.001


def test_relative_paths_in_a_file_are_read_from_its_folder(tmp_path, monkeypatch):
    """As YAML-driven tools do: the config means the same from any directory; what is typed in the shell
    (overrides) stays relative to the current directory."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "t.jsonl").write_text('{"text": "a"}\n')
    (folder / "c.yaml").write_text(
        "model: {path: models/base}\n"
        "data: {sources: [{path: data/t.jsonl}, {path: /abs/s.jsonl}], cache_dir: cache, chat_template: t.jinja}\n"
        "train: {output_dir: ../runs/x}\ncheckpoint: {dir: ckpt, resume: auto}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "c.yaml", ["checkpoint.dir=typed"])
    assert Path(cfg.data.sources[0].path).read_text() == '{"text": "a"}\n'
    assert cfg.data.sources[0].path == str(folder / "data" / "t.jsonl")
    assert cfg.data.sources[1].path == "/abs/s.jsonl"
    assert (cfg.model.path, cfg.data.cache_dir, cfg.data.chat_template) == (
        str(folder / "models" / "base"), str(folder / "cache"), str(folder / "t.jinja"))
    assert cfg.train.output_dir == str(tmp_path / "runs" / "x")
    assert (cfg.checkpoint.dir, cfg.checkpoint.resume) == ("typed", "auto")  # the override: cwd-relative
    # A relative config path gives paths relative to the current directory, still beside the file.
    monkeypatch.chdir(tmp_path)
    one = load_config("project/c.yaml", ["data.train_file=mine.jsonl", "data.sources=[]", "data.chat_template=chatml"])
    assert (one.data.train_file, one.data.cache_dir, one.data.chat_template) == (
        "mine.jsonl", "project/cache", "chatml")
    # A run's config.yaml holds absolute paths: it means the same wherever it is read from.
    dumped = tmp_path / "elsewhere" / "config.yaml"
    dumped.write_text(dump_config(one))
    again = load_config(dumped)
    assert (again.data.train_file, again.data.cache_dir) == (str(tmp_path / "mine.jsonl"),
                                                             str(folder / "cache"))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("five")
