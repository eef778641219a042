"""Generate a conversation data set with a realistic, long-tailed length distribution.

    python bench/make_chat_data.py OUT.jsonl --n 4000 --median 300 --max 4096 --seed 0

Each line is {"messages": [system?, user, assistant, (user, assistant)...]} of random lowercase
words. Total length per conversation is drawn from a log-normal with the given median (in
characters, about one token per character with the bundled tokenizer) and sigma 0.9, clipped to
[32, max]: most examples are short, a few are long, as in real chat fine-tuning sets. The generator
is shardtune.data.synthetic.long_chat (the GPU examples' data); this wrapper keeps the bench's command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without install

from shardtune.data.synthetic import long_chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--median", type=int, default=300)
    ap.add_argument("--max", type=int, default=4096)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for row in long_chat(args.n, args.seed, median=args.median, max_chars=args.max, sigma=args.sigma):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
