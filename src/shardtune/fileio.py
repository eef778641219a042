"""Small file helpers every package may use: JSON-able values, durable directory entries."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def jsonable(obj: Any) -> Any:
    """Scalars held as tensors (a tensor learning rate, as torchao's AdamW8bit keeps) -> Python numbers."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def fsync_dir(path: Path) -> None:
    """Make a rename or new file inside `path` durable (the directory entry itself is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
