"""Log every full (generation-2) garbage collection of every Python process that starts with this
folder on PYTHONPATH (the launcher, each rank, DCP's writer processes, the export):

    GC_LOG=/tmp/gc/run PYTHONPATH=bench/gclog:$PYTHONPATH python bench/checkpoint.py ...

writes /tmp/gc/run.PID lines: unix time, seconds the pass took, objects it freed, objects frozen.
"""

import gc
import os
import time

_log = os.environ.get("GC_LOG")
if _log:
    _started: dict[str, float] = {}

    def _note(phase: str, info: dict) -> None:
        if phase == "start":
            _started["t"] = time.perf_counter()
        elif info["generation"] == 2:
            took = time.perf_counter() - _started.get("t", time.perf_counter())
            with open(f"{_log}.{os.getpid()}", "a") as f:
                f.write(f"{time.time():.3f} {took:.4f} {info['collected']} {gc.get_freeze_count()}\n")

    gc.callbacks.append(_note)
