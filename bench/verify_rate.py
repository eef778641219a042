"""How fast `shardtune.checkpoint.layout.verify` reads a checkpoint back: a synthetic checkpoint of N GB
(8 files, as 2 ranks x 4 writer threads leave), manifest written by the real `finalize`, then verified.
Usage: python bench/verify_rate.py [GB] [DIR]. The files are in the page cache right after writing, as they
are when a run resumes on the machine that saved; from disk the rate is the disk's."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from shardtune.checkpoint.layout import finalize, verify

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
with tempfile.TemporaryDirectory(dir=sys.argv[2] if len(sys.argv) > 2 else None) as tmp:
    tmp_dir, final = Path(tmp) / ".step-00000001.tmp", Path(tmp) / "step-00000001"
    tmp_dir.mkdir()
    block = os.urandom(1 << 24)
    per_file = int(gb * 1e9 / 8)
    for i in range(8):
        with (tmp_dir / f"__{i}_0.distcp").open("wb") as f:
            for _ in range(per_file // len(block)):
                f.write(block)
    size = sum(f.stat().st_size for f in tmp_dir.iterdir())
    t = time.perf_counter()
    finalize(tmp_dir, final, {"step": 1})
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    verify(final)
    s = time.perf_counter() - t
    print(f"{size / 1e9:.2f} GB on {os.cpu_count()} cores: manifest (fsync + checksum) {write_s:.2f} s; "
          f"verify {s:.2f} s = {size / 1e9 / s:.2f} GB/s")
