"""Python API mirroring the CLI, for notebooks and scripts."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from shardtune.config import Config, dump_config, load_config


def train(config_or_path: Config | str | Path, overrides: list[str] | None = None, *,
          nproc: int | str | None = None, output_dir: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Run `shardtune train` (launched under torchrun, like the CLI) and return the run summary.

    Raises ShardtuneError for bad input and RuntimeError when the workers fail.
    """
    from shardtune.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(config_or_path, Config):
            path = Path(tmp) / "config.yaml"
            path.write_text(dump_config(config_or_path, redact=False))  # the run reads it back
        else:
            path = Path(config_or_path)
        argv = ["train", str(path), *(overrides or [])]
        if nproc is not None:
            argv += ["--nproc", str(nproc)]
        if output_dir is not None:
            argv += ["--output-dir", output_dir]
        if overwrite:
            argv.append("--overwrite")
        from shardtune.validate import validate

        # Check here first so bad input raises ShardtuneError with its message, as the CLI prints it.
        cfg = validate(str(path), [*(overrides or []), *([f"train.output_dir={output_dir}"] if output_dir else [])],
                       nproc_flag=nproc, quiet=True, overwrite=overwrite)
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"shardtune train exited with code {code}")
    return json.loads((Path(cfg.train.output_dir) / "summary.json").read_text())


__all__ = ["load_config", "train"]
