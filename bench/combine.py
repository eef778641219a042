"""Rows of several core.sh runs made in one device call (DIR/TAG/results.jsonl) in one table, with the ratios
against the baselines among them. bench/ab_1b.sh and bench/liger_chunk.sh run core.sh once per source tree or
chunk size, so each run's own table has no baseline to divide by.

    python3 bench/combine.py DIR TAG [TAG ...] [--ref hft_ds2] [--second-ref hft_ds2_liger] [--results OUT.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize import add_ratios, read_jsonl, render_table


def combine(folder: Path, tags: list[str], ref: str, second: str) -> list[dict]:
    """Every run of the tagged folders, shardtune runs named `TAG: VARIANT` (baselines keep their names, so
    they stay the ratios' denominators), with the ratios recomputed over all of them."""
    rows = []
    for tag in tags:
        path = folder / tag / "results.jsonl"
        if not path.is_file():
            continue
        for row in read_jsonl(path):
            if row.get("kind") != "baseline":
                row = {**row, "name": f"{tag}: {row['name']}"}
            rows.append(row)
    add_ratios(rows, ref, second)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("tags", nargs="+")
    ap.add_argument("--ref", default="hft_ds2")
    ap.add_argument("--second-ref", default="hft_ds2_liger")
    ap.add_argument("--results", type=Path, help="write the rows, with their ratios, here (one JSON line each)")
    args = ap.parse_args(argv)
    rows = combine(args.folder, args.tags, args.ref, args.second_ref)
    if args.results:
        args.results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(render_table(rows, args.ref, args.second_ref, spread=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
