"""Write a JSONL of long random texts so every training sequence is full (no padding).

    python3 bench/make_long_text.py OUT.jsonl --n 512 --chars 2300 --seed 0 --min-tokens 2048

Each line is {"text": "..."}: random lowercase words and numbers separated by single spaces. The
bundled tokenizer (``shardtune.models.tokenizer.load_tokenizer(None)``) is byte-level with only a
handful of merges (re, up, rev, cp), so it gives about one token per character. With
``--min-tokens`` (default 2048; 0 disables) every line is checked with that tokenizer and extended
until it encodes to at least that many tokens, so ``bos + text`` truncated to ``train.seq_len`` fills
the whole sequence, like the baseline's random token ids.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

LETTERS = string.ascii_lowercase
DIGITS = string.digits


def random_word(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 6)))
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10)))


def random_text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = random_word(rng)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


def _load_tokenizer():
    try:
        from shardtune.models.tokenizer import load_tokenizer
    except ImportError as err:  # shardtune not importable: cannot check
        print(f"make_long_text: cannot import shardtune ({err}); pass --min-tokens 0 to skip the check",
              file=sys.stderr)
        raise SystemExit(2) from None
    return load_tokenizer(None)


def make_lines(n: int, chars: int, seed: int, min_tokens: int = 0) -> list[str]:
    """``n`` random texts of about ``chars`` characters, each extended to >= ``min_tokens`` tokens."""
    rng = random.Random(seed)
    texts = [random_text(rng, chars) for _ in range(n)]
    if min_tokens > 0:
        tok = _load_tokenizer()
        for i, text in enumerate(texts):
            count = len(tok.encode(text, add_special_tokens=False))
            while count < min_tokens:
                text += " " + random_text(rng, 2 * (min_tokens - count) + 16)
                count = len(tok.encode(text, add_special_tokens=False))
            texts[i] = text
    return texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output JSONL path")
    ap.add_argument("--n", type=int, default=512, help="number of lines")
    ap.add_argument("--chars", type=int, default=2300, help="characters per line before the token check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=2048,
                    help="extend each line until the bundled tokenizer gives this many tokens (0 = no check)")
    args = ap.parse_args(argv)
    if args.n < 1 or args.chars < 1:
        ap.error("--n and --chars must be >= 1")
    texts = make_lines(args.n, args.chars, args.seed, args.min_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    lengths = [len(t) for t in texts]
    print(f"make_long_text: wrote {len(texts)} lines to {out} ({min(lengths)}-{max(lengths)} chars"
          + (f", each >= {args.min_tokens} tokens" if args.min_tokens > 0 else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
