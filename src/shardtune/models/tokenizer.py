"""The bundled tiny tokenizer (for the `tiny-llama` preset) and tokenizer loading.

The bundled tokenizer is a byte-level BPE trained on ``examples/data/tasks.jsonl``:

* Any input encodes: the 256 byte symbols are always in the vocabulary, so ``<unk>`` is never produced.
* Every digit, space and punctuation mark is its own pre-token, so numbers are spelled digit by digit
  (arithmetic is learnable) and merges never cross them.
* Letter runs may merge, but the bundled tokenizer is trained with a high ``min_frequency`` so only
  words that recur as words (the task names ``rev``, ``up``, ``cp``) merge; the random operand words
  stay one token per letter, which the reverse / upper-case / copy tasks need to be learnable.
* Special tokens have fixed ids: ``<pad>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, ``<unk>`` = 3.
  The bundled tokenizer also has chatml's ``<|im_start|>`` and ``<|im_end|>`` (ids 264, 265), since
  chatml is the chat template used when a tokenizer has none.
* Like Llama tokenizers, calling it with ``add_special_tokens=True`` (the default) prepends ``<s>`` and
  adds no ``</s>``. The data pipeline never relies on that: it encodes prompt and completion with
  ``add_special_tokens=False`` and prepends ``bos_token_id`` itself, so the prompt/completion boundary
  is exact for any tokenizer. For generation, ``tokenizer(prompt)`` therefore yields the same prefix
  (``<s>`` + prompt) the model was trained on.

Regenerate the bundled files with ``python -m shardtune.models.tokenizer``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # list order = ids 0..3
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # bundled tokenizer only: the next ids after the trained vocab
# Split before BPE: letter runs (mergeable), single digits, whitespace runs, single other characters.
_PRE_TOKEN_REGEX = r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]"
# Used for the bundled tokenizer: on tasks.jsonl a letter pair inside random words occurs ~100-300 times
# and the task names ~5,000 times, so 1,000 keeps the merges to the task names.
BUNDLED_MIN_FREQUENCY = 1000
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (digits split individually) with fixed special-token ids 0..3.

    ``vocab_size`` is an upper bound (it includes the 4 special tokens and 256 byte symbols); fewer
    tokens result when few pairs reach ``min_frequency``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is below {floor} (4 special tokens + 256 byte symbols)")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRE_TOKEN_REGEX), behavior="isolated"),
        # use_regex=False: the split above already decided the pieces; this only maps bytes to symbols.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # add_bos_token=True makes transformers install a "<s> $A" post-processor (Llama-style); no eos added.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        add_bos_token=True, add_eos_token=False, padding_side="right", model_max_length=512,
    )


def bundled_tokenizer_dir() -> Path:
    """Directory of the tokenizer shipped with the package (``shardtune/assets/tiny-tokenizer``)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tiny-tokenizer"


def _has_tokenizer_files(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(model_path: str | None, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer, or the bundled tiny tokenizer for presets; never downloads, and
    never runs the directory's code unless `trust_remote_code` (model.trust_remote_code).

    A tokenizer without a pad token gets its eos token as pad (labels mask padding, so the choice
    does not affect the loss).
    """
    from transformers import AutoTokenizer

    if model_path and not _has_tokenizer_files(Path(model_path)):
        from shardtune.errors import ShardtuneError

        # Falling back to the bundled tokenizer would train a real model on the wrong token ids.
        raise ShardtuneError(f"model.path: {model_path!r} has no tokenizer files (tokenizer.json or "
                             "tokenizer.model); copy the model's tokenizer into that directory")
    source = Path(model_path) if model_path else bundled_tokenizer_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "custom code" not in str(err):
            raise
        from shardtune.errors import ShardtuneError
        from shardtune.models.build import TRUST_HINT

        # tokenizer_config.json's auto_map names a tokenizer class only the folder's code defines.
        raise ShardtuneError(f"model.path: the tokenizer in {str(source)!r} needs its own Python code; "
                             f"{TRUST_HINT}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            from shardtune.errors import ShardtuneError

            raise ShardtuneError(f"tokenizer in {str(source)!r} has neither a pad nor an eos token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _task_texts(path: Path) -> Iterable[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield row["prompt"]
                yield row["completion"]


def main(argv: list[str] | None = None) -> None:
    """CLI: retrain the bundled tokenizer from tasks.jsonl and save it into the package assets."""
    ap = argparse.ArgumentParser(prog="python -m shardtune.models.tokenizer", description=main.__doc__)
    default_data = Path(__file__).resolve().parents[3] / "examples" / "data" / "tasks.jsonl"
    ap.add_argument("--data", default=str(default_data), help="JSONL with prompt/completion rows")
    ap.add_argument("--out", default=str(bundled_tokenizer_dir()), help="output directory")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--min-frequency", type=int, default=BUNDLED_MIN_FREQUENCY)
    args = ap.parse_args(argv)
    tokenizer = train_tokenizer(_task_texts(Path(args.data)), vocab_size=args.vocab_size,
                                min_frequency=args.min_frequency)
    # chatml is the fallback chat template: its turn markers get one id each (after the trained ones).
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    # transformers 5 writes its own class name (TokenizersBackend), which 4.x cannot resolve; the
    # PreTrainedTokenizerFast name loads the same tokenizer.json in both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"saved tokenizer with {len(tokenizer)} tokens to {out}")


if __name__ == "__main__":
    main()


def check_vocab(tokenizer: Any, hf_config: Any) -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    from shardtune.errors import ShardtuneError

    if len(tokenizer) > hf_config.vocab_size:
        raise ShardtuneError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                             f"{hf_config.vocab_size}; use the tokenizer that belongs to the model")
