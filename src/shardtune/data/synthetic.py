"""A deterministic toy prompt/completion task set that a ~3M-parameter Llama learns in a few hundred steps.

Four tasks, drawn uniformly at random:

* ``add``: ``"12+7="`` -> ``"19"`` (operands 0..99)
* ``rev``: ``"rev abc="`` -> ``"cba"``
* ``up``:  ``"up abc="`` -> ``"ABC"``
* ``cp``:  ``"cp abc="`` -> ``"abc"``

Words are 3..6 lowercase letters. Measured with the `tiny-llama` preset (fp32 CPU, batch 32, AdamW
lr 1e-3, 20 warmup steps, cosine, 300 steps): held-out loss per completion token falls from 6.3 to
0.38 and exact match rises from 0 to ~65% (cp/up ~98%, rev ~60%, add ~2%), so a short run shows a
clear learning curve and longer runs still have headroom. Prompts are unique, so a held-out
fraction really is unseen by training.

``examples/data/tasks.jsonl`` is ``generate(DEFAULT_N, DEFAULT_SEED)``; regenerate it with
``python -m shardtune.data.synthetic examples/data/tasks.jsonl``.

``long_chat`` is the other kind: conversations of random words whose lengths follow real chat sets (the GPU
examples train on it, so their tokens/s is real throughput); ``examples/data/chat_long.jsonl`` is
``python -m shardtune.data.synthetic examples/data/chat_long.jsonl --long-chat``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_N = 20_000
DEFAULT_SEED = 0
TASKS = ("add", "rev", "up", "cp")
MIN_WORD, MAX_WORD = 3, 6
# About n/4 examples are `add`, which has 10,000 distinct prompts; past ~3/4 of those rejection sampling crawls.
MAX_N = 30_000


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_WORD, MAX_WORD)))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def _rev(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"rev {w}=", w[::-1]


def _up(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"up {w}=", w.upper()


def _cp(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"cp {w}=", w


_MAKERS: dict[str, Callable[[random.Random], tuple[str, str]]] = {"add": _add, "rev": _rev, "up": _up, "cp": _cp}


def generate(n: int, seed: int) -> list[dict[str, str]]:
    """`n` unique-prompt examples ``{"prompt": ..., "completion": ...}``, identical for the same (n, seed)."""
    if not 0 <= n <= MAX_N:
        raise ValueError(f"n={n}: choose 0 <= n <= {MAX_N} (prompts are unique and `add` has only 100*100 of them)")
    rng = random.Random(seed)  # Python's Mersenne Twister: same stream on every platform and version
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    for _ in range(n):
        make = _MAKERS[rng.choice(TASKS)]
        # Redraw within the same task so duplicates do not skew the task mix.
        prompt, completion = make(rng)
        while prompt in seen:
            prompt, completion = make(rng)
        seen.add(prompt)
        out.append({"prompt": prompt, "completion": completion})
    return out


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> None:
    """One compact JSON object per line (compact keeps the shipped file well under 1 MB)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


SYSTEM = "Solve the task."
CHAT_N, CHAT_SEED = 9_000, 1


def as_chat(rows: list[dict[str, str]], seed: int) -> list[dict[str, list[dict[str, str]]]]:
    """Group task rows into conversations of 1-3 user/assistant turns (a third with a system turn),
    the `messages` format of `examples/data/tasks_chat.jsonl`: `as_chat(generate(CHAT_N, CHAT_SEED), CHAT_SEED)`."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(rows):
        turns = rows[i:i + rng.randint(1, 3)]
        i += len(turns)
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
        for row in turns:
            messages += [{"role": "user", "content": row["prompt"]},
                         {"role": "assistant", "content": row["completion"]}]
        out.append({"messages": messages})
    return out


# --- Long-tailed chat: the lengths of real chat fine-tuning sets, for throughput -------------------------------------
# Real chat sets are mostly short conversations with a long tail. Total characters per conversation follow a
# log-normal (median 300, sigma 0.9, clipped to [32, 4096]); the bundled tokenizer makes about one token per
# character, so padded to 2048 about 12% of the tokens are real and packing pays 7-10x (bench/RESULTS.md).
# `examples/data/chat_long.jsonl` is `long_chat(LONG_CHAT_N, 0)`; bench/make_chat_data.py writes larger ones.
LONG_CHAT_N = 1_500
_WORD_RNG = random.Random(1234)
WORDS = ["".join(_WORD_RNG.choice(string.ascii_lowercase) for _ in range(_WORD_RNG.randint(2, 9)))
         for _ in range(2000)]


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def conversation(rng: random.Random, total: int) -> dict[str, list[dict[str, str]]]:
    """One conversation of about `total` characters: a system turn (30%), then 1-3 user/assistant turns."""
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


def long_chat(n: int, seed: int, *, median: int = 300, max_chars: int = 4096,
              sigma: float = 0.9) -> list[dict[str, list[dict[str, str]]]]:
    """`n` conversations of random words with log-normal total lengths (characters), identical for the same
    arguments."""
    rng = random.Random(seed)
    return [conversation(rng, int(min(max_chars, max(32, rng.lognormvariate(math.log(median), sigma)))))
            for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m shardtune.data.synthetic OUT.jsonl --n N --seed S``."""
    ap = argparse.ArgumentParser(prog="python -m shardtune.data.synthetic",
                                 description="Write the synthetic prompt/completion task set as JSONL.")
    ap.add_argument("out", help="output JSONL path")
    ap.add_argument("--n", type=int, default=None,
                    help=f"number of examples (default {DEFAULT_N}; --long-chat: {LONG_CHAT_N})")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    ap.add_argument("--chat", action="store_true", help="group tasks into `messages` conversations")
    ap.add_argument("--long-chat", action="store_true",
                    help="long-tailed chat of random words instead of tasks (throughput runs)")
    ap.add_argument("--median", type=int, default=300, help="--long-chat: median characters (about tokens)")
    ap.add_argument("--max", type=int, default=4096, help="--long-chat: longest conversation, characters")
    ap.add_argument("--sigma", type=float, default=0.9, help="--long-chat: log-normal sigma")
    args = ap.parse_args(argv)
    if args.long_chat:
        n = LONG_CHAT_N if args.n is None else args.n
        write_jsonl(long_chat(n, args.seed, median=args.median, max_chars=args.max, sigma=args.sigma), args.out)
        print(f"wrote {n} conversations to {args.out}")
        return
    n = DEFAULT_N if args.n is None else args.n
    rows = generate(n, args.seed)
    write_jsonl(as_chat(rows, args.seed) if args.chat else rows, args.out)
    print(f"wrote {n} tasks to {args.out}")


if __name__ == "__main__":
    main()
