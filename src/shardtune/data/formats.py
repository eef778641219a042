"""Row formats: detecting a row's format and turning a row into (input_ids, trainable) at full length.

Formats and their logical fields (``SourceConfig.fields`` maps them to columns):

* ``text`` (text): every token carries loss.
* ``prompt_completion`` (prompt, completion): loss on the completion; on everything with ``train_on: all``.
* ``alpaca`` (instruction, input, output): the standard Alpaca prompt (without the Input block when input is
  empty or missing) is the prompt, output is the completion.
* ``messages`` (messages: a list of {role, content}): rendered with a chat template; loss on the assistant
  turns (``train_on``: ``assistant`` = every assistant turn, ``completion`` = only the last one, ``all`` =
  every token).

Token-level rules, the same for every format (`RowEncoder`):

* bos: ``tokenizer.bos_token_id`` is prepended when the tokenizer has one and the encoded example does not
  already start with it (a chat template may render it, e.g. Llama 3's ``<|begin_of_text|>`` with a Llama 3
  tokenizer). bos never carries loss.
* eos: with ``add_eos`` the tokenizer's eos is appended unless the example already ends with it (for
  conversations: unless the rendered text, trailing whitespace aside, ends with the eos token, as zephyr's or
  an instruct tokenizer's own template does). The appended eos belongs to the last segment: it carries loss
  when that segment does (always for text, prompt_completion and alpaca; for a conversation when it ends with
  a trainable assistant turn, or with ``train_on: all``). The whitespace a template writes after a turn's end
  marker carries no loss, after the last turn as after the others (with ``train_on: all`` everything does).
  Chat templates end a turn with their own marker (``<|im_end|>``, ``<|eot_id|>``);
  the eos after it teaches a base model to stop even where generation stops only at eos.
* Prompt and completion are encoded separately (``add_special_tokens=False``) and concatenated, so the loss
  boundary is exact. A conversation is rendered once and tokenized once with offsets; a token carries loss
  when its characters overlap an assistant span: from where the assistant's content starts (the end of
  ``render(messages[:i], add_generation_prompt=True)``) to the end of its end-of-turn marker (the end of
  ``render(messages[:i+1])``, trailing whitespace excluded). So the end-of-turn token carries loss, the
  assistant header does not. A template that is not prefix-consistent (it renders earlier turns differently
  once later ones follow) falls back to finding the assistant's content (and the marker after it) in the
  rendered text; when the content is not there either, the row is a BadRow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shardtune.config import DEFAULT_FIELDS, SourceConfig
from shardtune.data.types import BadRow

# Bump when the encoding rules change, so cached tokens of the old rules are not reused.
ENCODER_VERSION = 2  # 2: no loss on the whitespace between the last turn's end marker and the eos
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "input", "output"),
    "text": ("text",),
}
TRAIN_ON = ("assistant", "completion", "all")
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def _has(row: dict[str, Any], column: str) -> bool:
    return row.get(column) is not None


def detect_format(row: dict[str, Any], source: SourceConfig) -> str | None:
    """The format of ``row`` under ``source``: its ``format`` unless ``auto``; else by the columns present.

    Order: messages > prompt_completion (prompt + completion) > alpaca (instruction + output) > text. A
    column counts as present when the row has it with a non-null value (Parquet and ``datasets`` rows carry
    every column of the schema, null where a row has none). None when no format fits.
    """
    if source.format != "auto":
        return source.format
    col = source.column
    if _has(row, col("messages")):
        return "messages"
    if _has(row, col("prompt")) and _has(row, col("completion")):
        return "prompt_completion"
    if _has(row, col("instruction")) and _has(row, col("output")):
        return "alpaca"
    if _has(row, col("text")):
        return "text"
    return None


def columns_for(fmt: str, source: SourceConfig) -> dict[str, str]:
    """Logical field -> column of the fields format ``fmt`` reads, with ``source.fields`` applied."""
    return {name: source.column(name) for name in FORMAT_FIELDS[fmt]}


def _hash(*parts: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class RenderSpec:
    """How rows of one source become tokens; ``fingerprint()`` goes into the tokenization cache key.

    format: a resolved format (not ``auto``); columns: logical field -> column (missing ones default to
    DEFAULT_FIELDS); chat_template: Jinja source for ``messages`` (None otherwise); train_on: ``assistant``,
    ``completion`` or ``all``; add_eos: end each example with the tokenizer's eos.
    """

    format: str
    columns: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    train_on: str = "assistant"
    add_eos: bool = True

    def __post_init__(self) -> None:
        if self.format not in FORMAT_FIELDS:
            raise ValueError(f"RenderSpec.format must be one of {', '.join(FORMAT_FIELDS)}, got {self.format!r}")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"RenderSpec.train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")
        if self.format == "messages" and not self.chat_template:
            raise ValueError("RenderSpec: format 'messages' needs a chat_template (see resolve_chat_template)")

    @classmethod
    def for_source(cls, fmt: str, source: SourceConfig, chat_template: str | None, train_on: str,
                   add_eos: bool) -> RenderSpec:
        """The spec of a source whose rows have format ``fmt`` (chat_template kept only for ``messages``)."""
        return cls(format=fmt, columns=columns_for(fmt, source),
                   chat_template=chat_template if fmt == "messages" else None, train_on=train_on, add_eos=add_eos)

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def column(self, name: str) -> str:
        """The column of logical field ``name``."""
        return self.columns.get(name, DEFAULT_FIELDS[name])

    def fingerprint(self) -> str:
        """A stable hash of every field and of the encoding rules' version."""
        return _hash("RenderSpec", ENCODER_VERSION, asdict(self))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of what encoding depends on: the tokenizer itself, its special tokens, its chat template.

    Fast tokenizers hash ``backend_tokenizer.to_str()`` (vocabulary, merges, normalizer, pre-tokenizer,
    added tokens); others hash their class name and sorted vocabulary.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body: Any = backend.to_str().encode()
    else:
        body = [type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())]
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    special["map"] = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    return _hash("tokenizer", body, special, getattr(tokenizer, "chat_template", None))


def _type_name(value: Any) -> str:
    return type(value).__name__


class RowEncoder:
    """Turns a row into ``(input_ids, trainable)`` at full length (the pipeline truncates later).

    ``trainable[i]`` says whether token i carries loss (its label is itself rather than -100). Raises
    BadRow with a short reason for anything wrong with the row's data; see the module docstring for the
    exact rules. Picklable (it is sent to tokenizer worker processes): it holds the tokenizer, which
    pickles through its serialized JSON, and the spec.
    """

    def __init__(self, tokenizer: Any, spec: RenderSpec) -> None:
        self.tokenizer = tokenizer
        self.spec = spec

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer"], state["spec"])  # type: ignore[misc]

    # ------------------------------------------------------------ fields

    def _field_name(self, logical: str) -> str:
        col = self.spec.column(logical)
        return repr(col) if col == logical else f"{col!r} ({logical})"

    def _get(self, row: dict[str, Any], logical: str, *, required: bool = True, nonempty: bool = True) -> str:
        col = self.spec.column(logical)
        if col not in row:
            if not required:
                return ""
            raise BadRow(f"missing field {self._field_name(logical)}")
        value = row[col]
        if value is None:
            if not required:
                return ""
            raise BadRow(f"field {self._field_name(logical)} is null")
        if not isinstance(value, str):
            raise BadRow(f"field {self._field_name(logical)} must be a string, got {_type_name(value)}")
        if nonempty and not value.strip():
            raise BadRow(f"field {self._field_name(logical)} is empty")
        return value

    # ------------------------------------------------------------ encoding

    def _tokenize(self, text: str, **kwargs: Any) -> Any:
        try:
            return self.tokenizer(text, add_special_tokens=False, verbose=False, **kwargs)
        except (TypeError, ValueError):
            # JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer can encode.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise BadRow(f"invalid Unicode: unpaired surrogate {text[err.start]!r}") from None
            raise

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenize(text)["input_ids"]) if text else []

    def _finish(self, ids: list[int], mask: list[bool], eos_trainable: bool, ends_with_eos: bool = False,
                ) -> tuple[list[int], list[bool]]:
        """Apply the bos and eos rules (module docstring) to the encoded example."""
        tok = self.tokenizer
        bos, eos = tok.bos_token_id, tok.eos_token_id
        if bos is not None:
            if ids and ids[0] == bos:
                mask[0] = False
            else:
                ids, mask = [bos, *ids], [False, *mask]
        if self.spec.add_eos and eos is not None and not ends_with_eos and not (ids and ids[-1] == eos):
            # The eos carries loss where the last segment does; what lies between them (the newline a chat
            # template writes after its end-of-turn marker) does not, as after every earlier turn.
            ids, mask = [*ids, eos], [*mask, eos_trainable]
        return ids, mask

    def _segments(self, prompt: str, completion: str, name: str) -> tuple[list[int], list[bool]]:
        p, c = self._encode(prompt), self._encode(completion)
        if not c:
            raise BadRow(f"field {self._field_name(name)} encodes to no tokens")
        every = self.spec.train_on == "all"
        return self._finish(p + c, [every] * len(p) + [True] * len(c), eos_trainable=True)

    def __call__(self, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
        if not isinstance(row, dict):
            raise BadRow(f"expected an object with fields, got {_type_name(row)}")
        fmt = self.spec.format
        if fmt == "text":
            ids = self._encode(self._get(row, "text"))
            return self._finish(ids, [True] * len(ids), eos_trainable=True)
        if fmt == "prompt_completion":
            prompt = self._get(row, "prompt", nonempty=False)
            return self._segments(prompt, self._get(row, "completion"), "completion")
        if fmt == "alpaca":
            instruction = self._get(row, "instruction")
            inp = self._get(row, "input", required=False, nonempty=False)
            output = self._get(row, "output")
            if inp.strip():
                prompt = ALPACA_PROMPT.format(instruction=instruction, input=inp)
            else:
                prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
            return self._segments(prompt, output, "output")
        return self._messages(row)

    # ------------------------------------------------------------ conversations

    def _conversation(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        col = self.spec.column("messages")
        if col not in row:
            raise BadRow(f"missing field {self._field_name('messages')}")
        msgs = row[col]
        if isinstance(msgs, str) and msgs.lstrip().startswith("["):
            try:  # CSV cells and some exports hold the conversation as a JSON string
                msgs = json.loads(msgs)
            except ValueError:
                raise BadRow(f"field {self._field_name('messages')} is a string but not a JSON list") from None
        if msgs is None:
            raise BadRow(f"field {self._field_name('messages')} is null")
        if not isinstance(msgs, (list, tuple)):
            raise BadRow(f"field {self._field_name('messages')} must be a list of {{role, content}} messages, "
                         f"got {_type_name(msgs)}")
        if not msgs:
            raise BadRow("empty conversation")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRow(f"message {i} must be an object with 'role' and 'content', got {_type_name(m)}")
            role = m.get("role")
            if role is None:
                raise BadRow(f"message {i} has no 'role'")
            if not isinstance(role, str) or not role:
                raise BadRow(f"message {i}: role must be a non-empty string, got {role!r}")
            content = m.get("content")
            if content is None:
                raise BadRow(f"message {i} ({role}) has no 'content'")
            if not isinstance(content, str):
                raise BadRow(f"message {i} ({role}): content must be a string, got {_type_name(content)}")
            # Parquet / datasets rows carry every key of the schema, null where a message has none.
            out.append({k: v for k, v in m.items() if v is not None})
        return out

    def _render(self, msgs: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(msgs, chat_template=self.spec.chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as err:  # raise_exception in the template, or a syntax error
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise BadRow(msg if msg.startswith("unknown role") else f"chat template error: {msg}") from None
        except Exception as err:  # whatever a template does with odd data, the row is bad
            raise BadRow(f"chat template error: {type(err).__name__}: {err}") from None
        if not isinstance(text, str):
            raise BadRow(f"chat template error: rendered {_type_name(text)}, not text")
        return text

    def _span(self, full: str, msgs: list[dict[str, Any]], i: int, cursor: int) -> tuple[int, int]:
        """Character span of assistant message i in ``full``: its content and end-of-turn marker."""
        upto = self._render(msgs[: i + 1])
        if i > 0 and full.startswith(upto):
            gen = self._render(msgs[:i], add_generation_prompt=True)
            start = len(gen)
            if full.startswith(gen) and cursor <= start <= len(upto):
                return start, max(start, len(upto.rstrip()))
        # Not prefix-consistent (or a conversation that opens with the assistant): find the content itself.
        content = msgs[i]["content"].strip()
        if not content:
            return cursor, cursor
        if full.startswith(upto):
            start = upto.rfind(content, cursor)
            if start >= 0:
                return start, max(start + len(content), len(upto.rstrip()))
        start = full.find(content, cursor)
        if start < 0:
            raise BadRow(f"chat template is not prefix-consistent and changes message {i} (assistant); "
                         "cannot tell which tokens are the assistant's")
        end = start + len(content)
        k = upto.rfind(content)
        marker = upto[k + len(content):].rstrip() if k >= 0 else ""
        if marker and full.startswith(marker, end):
            end += len(marker)
        return start, end

    def _tokenize_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        """Tokenize ``text`` once; a token is trainable when its characters overlap a span."""
        try:
            enc = self._tokenize(text, return_offsets_mapping=True)
            offsets = enc["offset_mapping"]
        except NotImplementedError:  # a slow tokenizer has no offsets: encode the pieces between boundaries
            return self._tokenize_pieces(text, spans)
        ids = list(enc["input_ids"])
        mask = [False] * len(ids)
        spans = [(lo, hi) for lo, hi in spans if hi > lo]  # sorted and disjoint
        s = 0
        for t, (a, b) in enumerate(offsets):
            while s < len(spans) and spans[s][1] <= a:
                s += 1
            if s == len(spans):
                break
            lo = spans[s][0]
            # Overlap; a zero-width token (a == b) counts when it lies strictly inside the span.
            mask[t] = b > lo if a < b else lo < a
        return ids, mask

    def _tokenize_pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        pos = 0
        for lo, hi in [*spans, (len(text), len(text))]:
            for piece, flag in ((text[pos:lo], False), (text[lo:hi], True)):
                piece_ids = self._encode(piece)
                ids += piece_ids
                mask += [flag] * len(piece_ids)
            pos = hi
        return ids, mask

    def _messages(self, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
        msgs = self._conversation(row)
        train_on = self.spec.train_on
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if train_on != "all" and not assistant:
            raise BadRow(f"no assistant turn (train_on={train_on} needs one)")
        full = self._render(msgs)
        if not full:
            raise BadRow("chat template rendered nothing")
        if train_on == "all":
            spans = [(0, len(full))]
        else:
            targets = assistant if train_on == "assistant" else assistant[-1:]
            spans = []
            cursor = 0
            for i in targets:
                lo, hi = self._span(full, msgs, i, cursor)
                spans.append((lo, hi))
                cursor = hi
        ids, mask = self._tokenize_spans(full, spans)
        eos_token = self.tokenizer.eos_token
        ends_with_eos = bool(eos_token) and full.rstrip().endswith(eos_token)
        eos_trainable = train_on == "all" or msgs[-1]["role"] == "assistant"
        return self._finish(ids, mask, eos_trainable=eos_trainable, ends_with_eos=ends_with_eos)


# ---------------------------------------------------------------- showing the loss mask


def loss_runs(input_ids: list[int], trainable: list[bool], tokenizer: Any) -> list[tuple[str, bool]]:
    """Consecutive tokens with the same flag, decoded: ``[(text, carries_loss), ...]`` covering every token.

    Each run is decoded as the difference of decoding the whole prefix up to its end and up to its start,
    so tokenizers that drop a leading space when decoding a run alone (sentencepiece) still show it.
    """
    if len(input_ids) != len(trainable):
        raise ValueError(f"{len(input_ids)} input ids but {len(trainable)} trainable flags")

    def dec(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    runs: list[tuple[str, bool]] = []
    start = 0
    prev_text = ""
    for end in range(1, len(input_ids) + 1):
        if end < len(input_ids) and trainable[end] == trainable[start]:
            continue
        text = dec(input_ids[:end])
        piece = text[len(prev_text):] if text.startswith(prev_text) else dec(input_ids[start:end])
        runs.append((piece, bool(trainable[start])))
        prev_text, start = text, end
    return runs


LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"


def render_example(row: dict[str, Any], spec: RenderSpec, tokenizer: Any) -> str:
    """The encoded row as text, each run of tokens that carries loss inside ⟦ ⟧ (for ``shardtune validate``).

    Raises BadRow like `RowEncoder`. Use `loss_runs` for the runs themselves (to colour them).
    """
    ids, mask = RowEncoder(tokenizer, spec)(row)
    return "".join(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if flag else text for text, flag in loss_runs(ids, mask, tokenizer))
