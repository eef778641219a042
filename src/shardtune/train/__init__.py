"""The training loop, its optimizer factory and schedule, and the loss.

`shardtune.train` is also the public API function (`shardtune.train(config, overrides, ...)`). Once this
subpackage is imported (any import of `shardtune.train.loop` does it), Python binds the name `train` on the
`shardtune` package to this module, which would hide the function. This module is therefore callable: calling
it is calling `shardtune.api.train`, so `shardtune.train(...)` works whatever was imported before.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from shardtune.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
