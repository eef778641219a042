"""shardtune: sharded fine-tuning of Hugging Face causal LMs with one config and one command."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `import shardtune` stays cheap (no torch import) until something is used.
    if name in ("train",):
        from shardtune import api

        return getattr(api, name)
    if name in ("load_config", "Config"):
        from shardtune import config

        return getattr(config, name)
    raise AttributeError(f"module 'shardtune' has no attribute {name!r}")


__all__ = ["Config", "__version__", "load_config", "train"]
