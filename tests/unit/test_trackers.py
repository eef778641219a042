"""Trackers (metrics/trackers.py): which numbers of a record they get, and the refusal of one that is configured
but not installed or does not start. What TensorBoard, W&B (offline) and MLflow (a file store) received from a
real run is read back in tests/dist/test_monitors.py."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import MICRO, ROOT, one_line_error, shardtune

from shardtune.config import load_config
from shardtune.errors import ShardtuneError
from shardtune.metrics.trackers import _flat, configured, make_trackers, scalars

TINY = str(ROOT / "examples" / "tiny.yaml")


def test_a_record_becomes_train_or_eval_scalars():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": None, "grad_norm": math.nan, "skipped_steps": 0,
              "peak_mem_gib_ranks": [1.0, 1.1], "variant": "x", "eval": False, "stopped": True}
    assert scalars(record) == {"train/loss": 2.5, "train/lr": 1e-3, "train/skipped_steps": 0.0}
    assert scalars({"step": 3, "eval": True, "eval_loss": 1.5}) == {"eval/eval_loss": 1.5}


def test_the_keys_and_what_they_turn_on():
    cfg = load_config(TINY, ["log.tensorboard=true", "log.wandb={project: p, mode: offline}",
                             "log.mlflow={experiment: e}"])
    assert configured(cfg.log) == ["tensorboard", "wandb", "mlflow"]
    assert cfg.log.wandb.mode == "offline" and cfg.log.mlflow.tracking_uri is None
    assert configured(load_config(TINY, []).log) == []
    assert _flat({"a": {"b": 1, "c": {"d": "x" * 600}}}) == {"a.b": "1", "a.c.d": "x" * 500}


@pytest.mark.parametrize("key, value", [("wandb", "{project: p}"), ("mlflow", "{experiment: e}")])
def test_a_tracker_that_is_not_installed_is_refused_in_one_line(cli, monkeypatch, key, value):
    # CI installs both; None in sys.modules is Python's own way to make a module unimportable (find_spec: None).
    monkeypatch.setitem(sys.modules, key, None)
    one_line_error(cli("validate", TINY, f"log.{key}={value}"), f"log.{key}: the {key} package is not installed",
                   f"pip install {key}")


def test_a_tracker_that_does_not_start_stops_the_run_in_one_line(tmp_path):
    """Installed but not starting (here MLflow, the real package, given a tracking URI it has no store for): one
    line naming the tracker and MLflow's own reason, before any training."""
    cfg = load_config(TINY, ["log.mlflow={experiment: e, tracking_uri: 'nosuch://host/x'}"])
    with pytest.raises(ShardtuneError) as err:
        make_trackers(cfg.log, tmp_path, {})
    message = str(err.value)
    assert message.startswith("log.mlflow: mlflow did not start: ") and "nosuch" in message, message
    assert "\n" not in message


def test_a_run_whose_tracker_does_not_start_exits_2_in_one_line(tmp_path, data_cache):
    """The same through the real `shardtune train` on 2 processes (a subprocess: torch's launcher logs to the
    stderr it found first): rank 0 makes the trackers; the run stops at its start with the tracker's line, exit 2,
    no traceback (rank 1, waiting in a collective, is ended by the launcher)."""
    proc = shardtune("train", TINY, MICRO, "--nproc", "2", "--output-dir", str(tmp_path / "run"),
                     "train.max_steps=2", f"data.cache_dir={data_cache}",
                     "log.mlflow={experiment: e, tracking_uri: 'nosuch://host/x'}")
    # Workers print their libraries' warnings too (as in test_run_safety): one error line among them.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: log.mlflow: mlflow did not start: "), proc.stderr
    assert "nosuch" in errors[0]


# ---- secrets: masked in what the trackers, config.yaml and the report get; the run itself keeps them --------------

SECRET_ENV = {"WANDB_API_KEY": "wandbkeymark0123", "HF_TOKEN": "hftokenmark4567",
              "MLFLOW_TRACKING_PASSWORD": "mlflowpassmark89"}
SECRET_URI = "https://user:SECRETMARK@mlflow.example/base?api_key=QUERYMARK&view=1"
MARKERS = ["SECRETMARK", "QUERYMARK", *SECRET_ENV.values()]


def _secret_config(monkeypatch):
    """A config that holds credentials the way users put them there: a tracking URI with user:password@ and an API
    key parameter, and W&B's API key pasted into log.wandb.entity (a value only the environment scrub catches)."""
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    return load_config(TINY, ["log.tensorboard=true", f"log.mlflow={{experiment: e, tracking_uri: '{SECRET_URI}'}}",
                              f"log.wandb={{project: p, mode: offline, entity: {SECRET_ENV['WANDB_API_KEY']}}}"])


def _fake_module(monkeypatch, name: str, **functions) -> None:
    import types

    module = types.ModuleType(name)
    for fname, fn in functions.items():
        setattr(module, fname, fn)
    monkeypatch.setitem(sys.modules, name, module)


def _leaks(text: str) -> list[str]:
    return [m for m in MARKERS if m in text]


def test_the_trackers_get_the_config_without_its_secrets_and_mlflow_connects_with_them(tmp_path, monkeypatch):
    """TensorBoard is the real one (its event file read back as bytes); W&B and MLflow are fakes that record their
    calls (the real ones would go to the network with these settings)."""
    cfg = _secret_config(monkeypatch)
    calls: dict = {}

    def wandb_init(**kwargs):
        calls["wandb"] = kwargs
        return type("Run", (), {"log": lambda self, metrics, step: None, "finish": lambda self: None})()

    _fake_module(monkeypatch, "wandb", init=wandb_init)
    _fake_module(monkeypatch, "mlflow", set_tracking_uri=lambda uri: calls.setdefault("uri", uri),
                 set_experiment=lambda name: None, start_run=lambda run_name: None, end_run=lambda: None,
                 log_params=lambda params: calls.setdefault("params", params))
    trackers = make_trackers(cfg.log, tmp_path, cfg.model_dump(mode="json", by_alias=True))  # as the loop calls it
    for tracker in trackers:
        tracker.close()
    assert calls["uri"] == SECRET_URI and calls["wandb"]["entity"] == SECRET_ENV["WANDB_API_KEY"]  # the run's own
    params = calls["params"]
    assert params["log.mlflow.tracking_uri"] == "https://***@mlflow.example/base?api_key=***&view=1"
    assert params["log.wandb.entity"] == "***" and params["train.lr"] == "0.001"  # the rest as it was
    assert not _leaks(repr(params)) and not _leaks(repr(calls["wandb"]["config"]))
    events = b"".join(f.read_bytes() for f in (tmp_path / "tensorboard").iterdir())
    assert b"mlflow.example" in events and not _leaks(events.decode("latin-1"))


def test_config_yaml_and_the_report_show_no_secret(tmp_path, monkeypatch):
    """config.yaml as dump_config writes it; the report of a run whose config.yaml was written unmasked (before
    shardtune masked it) still shows none; redact=False (a file a run reads back) keeps them."""
    import json

    from shardtune.config import dump_config
    from shardtune.report import write_report

    cfg = _secret_config(monkeypatch)
    assert not _leaks(dump_config(cfg)) and "https://***@mlflow.example" in dump_config(cfg)
    assert set(_leaks(dump_config(cfg, redact=False))) == {"SECRETMARK", "QUERYMARK", "wandbkeymark0123"}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg, redact=False))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run / "summary.json").write_text(json.dumps({"model_dir": f"{SECRET_URI}/model"}))
    page = write_report([run], tmp_path / "report").read_text()
    assert "mlflow.example" in page and not _leaks(page), _leaks(page)


def test_a_tracker_that_does_not_start_does_not_print_the_uri_credentials(monkeypatch):
    from shardtune.metrics.trackers import _start

    def refuse():
        raise RuntimeError(f"API request to {SECRET_URI} failed")

    with pytest.raises(ShardtuneError) as err:
        _start("mlflow", refuse)
    assert "https://***@mlflow.example" in str(err.value) and not _leaks(str(err.value))


def test_a_checkpoints_trainer_state_records_the_config_masked_once(monkeypatch):
    """trainer_state.json (every checkpoint) holds the config without its secrets, masked at the first save and
    kept for the later ones (the config does not change while the run goes on)."""
    from types import SimpleNamespace

    from shardtune.train.loop import trainer_state

    cfg = _secret_config(monkeypatch)
    run = SimpleNamespace(cfg=cfg, saved_config={}, total_steps=10, ctx=SimpleNamespace(world=2),
                          sampler=SimpleNamespace(state_dict=lambda: {"epoch": 0}, global_batch=4),
                          schedule=SimpleNamespace(state_dict=lambda: {"last_epoch": 3}),
                          backend=SimpleNamespace(extra_state=lambda: {}),
                          state=SimpleNamespace(step=3, skipped=0))
    first = trainer_state(run)
    assert first["config"]["log"]["mlflow"]["tracking_uri"] == "https://***@mlflow.example/base?api_key=***&view=1"
    assert not _leaks(repr(first)) and first["config"]["train"]["lr"] == 0.001
    run.state.step = 6
    again = trainer_state(run)
    assert again["step"] == 6 and again["config"] is first["config"]
