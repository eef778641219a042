"""Experiment trackers beside metrics.jsonl, on rank 0, each optional and off unless configured:

- `log.tensorboard: true`: TensorBoard event files in OUTPUT_DIR/tensorboard (`torch.utils.tensorboard`, needs
  the `tensorboard` package); `tensorboard --logdir OUTPUT_DIR/tensorboard` shows them. Local files only.
- `log.wandb: {project: P}`: Weights & Biases (`wandb`), files under OUTPUT_DIR/wandb; `mode: offline` keeps it
  local (`wandb sync` uploads later). Its API key comes from wandb's own login or WANDB_API_KEY, never the config.
- `log.mlflow: {experiment: E}`: MLflow (`mlflow`), to `tracking_uri` (default: MLflow's own, ./mlruns or
  MLFLOW_TRACKING_URI).

Each gets every record metrics.jsonl gets: train records' numbers as train/KEY, evaluation records' as eval/KEY,
at the record's optimizer step; the resolved config once at the start. A tracker that is configured but not
installed is refused before the run starts (validate), in one line with the install command; one that is
installed but does not start (wandb online without a login, MLflow 3 refusing a file store without
MLFLOW_ALLOW_FILE_STORE=true) stops the run at its start in one line naming the tracker and the package's reason.

Secrets stay out of what they receive: `redact` masks the credentials of every URL in the config (user:password@,
query parameters named like token, key, secret, password or signature) and the values of secret-named environment
variables (WANDB_API_KEY, HF_TOKEN, MLFLOW_TRACKING_PASSWORD, ...) before the config is logged, saved
(config.yaml) or shown (the report). The run itself uses the values as given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shardtune.redact import redact, redact_text

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers as train/KEY or eval/KEY (flags and per-rank lists left out)."""
    prefix = "eval/" if record.get("eval") else "train/"
    out = {}
    for key, value in record.items():
        if key in ("step", "eval") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[prefix + key] = float(value)
    return out


class TensorBoardTracker:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, out: Path, config: dict[str, Any], settings: Any) -> None:
        import wandb

        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or out.name,
                              dir=str(out), mode=settings.mode, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, out: Path, config: dict[str, Any], settings: Any) -> None:
        import mlflow

        if settings.tracking_uri:
            mlflow.set_tracking_uri(settings.tracking_uri)
        mlflow.set_experiment(settings.experiment)
        self.mlflow = mlflow
        mlflow.start_run(run_name=settings.run_name or out.name)
        mlflow.log_params(_flat(config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        # MLflow's metric names allow '/'.
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: dotted keys, values as text (its values are limited in length)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = str(value)[:500]
    return out


def configured(log_cfg: Any) -> list[str]:
    """The trackers the config turns on, by package name."""
    return [name for name, on in (("tensorboard", log_cfg.tensorboard), ("wandb", log_cfg.wandb is not None),
                                  ("mlflow", log_cfg.mlflow is not None)) if on]


def make_trackers(log_cfg: Any, out: Path, config: dict[str, Any]) -> list[Tracker]:
    """The configured trackers (call on rank 0 only). They log `config` with its secrets masked; MLflow connects to
    log_cfg.mlflow.tracking_uri as given."""
    config = redact(config)
    makers: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(out, config),
        "wandb": lambda: WandbTracker(out, config, log_cfg.wandb),
        "mlflow": lambda: MlflowTracker(out, config, log_cfg.mlflow),
    }
    return [_start(name, makers[name]) for name in configured(log_cfg)]


def _start(name: str, make: Callable[[], Tracker]) -> Tracker:
    """The tracker, or a one-line error with the package's own first line of why it did not start."""
    from shardtune.errors import ShardtuneError

    try:
        return make()
    except Exception as err:
        # The package's message may quote the tracking URI it was given, credentials and all.
        why = redact_text((str(err).strip().splitlines() or [type(err).__name__])[0])
        raise ShardtuneError(f"log.{name}: {PACKAGES[name]} did not start: {why}") from err
