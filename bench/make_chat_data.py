"""Generate a conversation data set with a realistic, long-tailed length distribution.

    python bench/make_chat_data.py OUT.jsonl --n 4000 --median 300 --max 4096 --seed 0

Each line is {"messages": [system?, user, assistant, (user, assistant)...]} of random lowercase
words. Total length per conversation is drawn from a log-normal with the given median (in
characters, about one token per character with the bundled tokenizer) and sigma 0.9, clipped to
[32, max]: most examples are short, a few are long, as in real chat fine-tuning sets.
"""

from __future__ import annotations

import argparse
import json
import math
import random

_WRNG = random.Random(1234)
WORDS = ["".join(_WRNG.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_WRNG.randint(2, 9))) for _ in range(2000)]


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def conversation(rng: random.Random, total: int) -> dict:
    turns = 1 if total < 400 else rng.randint(1, 3)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _text(rng, 40)})
    per_turn = max(16, total // turns)
    for _ in range(turns):
        share = rng.uniform(0.15, 0.5)  # the answer is usually the longer part
        messages.append({"role": "user", "content": _text(rng, max(4, int(per_turn * share)))})
        messages.append({"role": "assistant", "content": _text(rng, max(4, int(per_turn * (1 - share))))})
    return {"messages": messages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--median", type=int, default=300)
    ap.add_argument("--max", type=int, default=4096)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.n):
            total = int(min(args.max, max(32, rng.lognormvariate(math.log(args.median), args.sigma))))
            f.write(json.dumps(conversation(rng, total)) + "\n")


if __name__ == "__main__":
    main()
