"""Row formats: detection, exact loss masks per format and train_on, bos/eos, bad rows, chat templates."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from shardtune.config import SourceConfig
from shardtune.data.formats import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    RenderSpec,
    RowEncoder,
    columns_for,
    detect_format,
    loss_runs,
    render_example,
    tokenizer_fingerprint,
)
from shardtune.data.templates import CHAT_TEMPLATES, resolve_chat_template
from shardtune.data.types import BadRow
from shardtune.errors import ShardtuneError
from shardtune.models.tokenizer import load_tokenizer

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def spec(fmt: str, train_on: str = "assistant", add_eos: bool = True, template: str | None = None,
         **columns: str) -> RenderSpec:
    tpl = CHAT_TEMPLATES.get(template, template)
    return RenderSpec(fmt, dict(columns), tpl if fmt == "messages" else None, train_on, add_eos)


def runs(tok, row, s: RenderSpec) -> list[tuple[str, bool]]:
    ids, mask = RowEncoder(tok, s)(row)
    assert len(ids) == len(mask)
    return loss_runs(ids, mask, tok)


def trained(tok, row, s: RenderSpec) -> list[str]:
    """The decoded runs of tokens that carry loss."""
    return [text for text, flag in runs(tok, row, s) if flag]


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(("row", "fmt"), [
    ({"messages": [], "prompt": "p", "completion": "c", "text": "t"}, "messages"),
    ({"prompt": "p", "completion": "c", "instruction": "i", "output": "o", "text": "t"}, "prompt_completion"),
    ({"prompt": "p", "instruction": "i", "output": "o", "text": "t"}, "alpaca"),
    ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
    ({"prompt": "p", "text": "t"}, "text"),
    ({"messages": None, "text": "t"}, "text"),  # a null column (Parquet schema) does not count
    ({"prompt": "p"}, None),
    ({}, None),
])
def test_detect_format(row, fmt):
    assert detect_format(row, SourceConfig(path="x.jsonl")) == fmt


def test_detect_format_with_field_mapping_and_explicit_format():
    src = SourceConfig(path="x.jsonl", fields={"prompt": "question", "completion": "answer", "messages": "conv"})
    assert detect_format({"question": "q", "answer": "a"}, src) == "prompt_completion"
    assert detect_format({"prompt": "q", "completion": "a"}, src) is None
    assert detect_format({"conv": [], "question": "q", "answer": "a"}, src) == "messages"
    assert detect_format({"anything": 1}, SourceConfig(path="x.jsonl", format="alpaca")) == "alpaca"
    assert columns_for("prompt_completion", src) == {"prompt": "question", "completion": "answer"}
    assert columns_for("alpaca", SourceConfig(path="x")) == {"instruction": "instruction", "input": "input",
                                                             "output": "output"}


# ---------------------------------------------------------------- text / prompt_completion / alpaca


def test_text_every_token_trainable_bos_not(tok):
    ids, mask = RowEncoder(tok, spec("text"))({"text": "rev abc=cba"})
    assert ids == [BOS, *enc(tok, "rev abc=cba"), EOS]
    assert mask == [False] + [True] * (len(ids) - 1)
    ids2, mask2 = RowEncoder(tok, spec("text", train_on="all", add_eos=False))({"text": "rev abc=cba"})
    assert ids2 == ids[:-1] and mask2 == mask[:-1]


def test_prompt_completion_exact_positions(tok):
    p, c = enc(tok, "12+7="), enc(tok, "19")
    ids, mask = RowEncoder(tok, spec("prompt_completion"))({"prompt": "12+7=", "completion": "19", "x": 1})
    assert ids == [BOS, *p, *c, EOS]
    assert mask == [False] * (1 + len(p)) + [True] * (len(c) + 1)
    # train_on completion is the same; all trains the prompt too (never bos)
    assert RowEncoder(tok, spec("prompt_completion", "completion"))({"prompt": "12+7=", "completion": "19"}) == (
        ids, mask)
    ids_all, mask_all = RowEncoder(tok, spec("prompt_completion", "all"))({"prompt": "12+7=", "completion": "19"})
    assert ids_all == ids and mask_all == [False] + [True] * (len(ids) - 1)


def test_prompt_completion_boundary_is_exact(tok):
    # Encoded separately: "ab" + "c" never merges across the boundary even if "abc" would.
    ids, mask = RowEncoder(tok, spec("prompt_completion", add_eos=False))({"prompt": "rev", "completion": " rev"})
    assert ids == [BOS, *enc(tok, "rev"), *enc(tok, " rev")]
    assert [t for t, m in zip(ids, mask, strict=True) if m] == enc(tok, " rev")


def test_prompt_completion_mapped_columns_and_empty_prompt(tok):
    s = spec("prompt_completion", prompt="q", completion="a")
    ids, mask = RowEncoder(tok, s)({"q": "", "a": "up"})
    assert ids == [BOS, *enc(tok, "up"), EOS] and mask == [False, True, True]


def test_alpaca_prompts(tok):
    row = {"instruction": "Reverse it.", "input": "abc", "output": "cba"}
    prompt = ALPACA_PROMPT.format(instruction="Reverse it.", input="abc")
    assert prompt.startswith("Below is an instruction") and "### Input:\nabc\n\n### Response:\n" in prompt
    ids, mask = RowEncoder(tok, spec("alpaca"))(row)
    assert ids == [BOS, *enc(tok, prompt), *enc(tok, "cba"), EOS]
    assert mask == [False] * (1 + len(enc(tok, prompt))) + [True] * (len(enc(tok, "cba")) + 1)
    no_input = ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.")
    assert "### Input" not in no_input
    for r in ({"instruction": "Say hi.", "output": "hi"}, {"instruction": "Say hi.", "input": "", "output": "hi"},
              {"instruction": "Say hi.", "input": None, "output": "hi"}):
        assert runs(tok, r, spec("alpaca")) == [("<s>" + no_input, False), ("hi</s>", True)]


# ---------------------------------------------------------------- bos / eos


def test_eos_not_doubled_and_optional(tok):
    ids, mask = RowEncoder(tok, spec("text"))({"text": "abc</s>"})
    assert ids == [BOS, *enc(tok, "abc"), EOS] and ids.count(EOS) == 1 and mask[-1]
    ids, _ = RowEncoder(tok, spec("prompt_completion", add_eos=False))({"prompt": "a", "completion": "b"})
    assert EOS not in ids


def test_bos_not_doubled(tok):
    ids, mask = RowEncoder(tok, spec("text"))({"text": "<s>abc"})
    assert ids == [BOS, *enc(tok, "abc"), EOS] and mask[0] is False
    ids, mask = RowEncoder(tok, spec("prompt_completion", "all"))({"prompt": "<s>q", "completion": "a"})
    assert ids.count(BOS) == 1 and mask[0] is False and all(mask[1:])


def test_tokenizer_without_bos_or_eos(tok):
    t = copy.deepcopy(tok)
    t.bos_token = None
    t.eos_token = None
    assert t.bos_token_id is None and t.eos_token_id is None
    ids, mask = RowEncoder(t, spec("prompt_completion"))({"prompt": "a", "completion": "b"})
    assert ids == [*enc(tok, "a"), *enc(tok, "b")] and mask == [False, True]


def test_llama3_template_with_a_llama3_bos_token_gets_no_extra_bos(tok):
    t = copy.deepcopy(tok)
    t.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    begin = t.convert_tokens_to_ids("<|begin_of_text|>")
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ids, mask = RowEncoder(t, spec("messages", template="llama3"))(row)
    assert ids[0] == begin and ids.count(begin) == 1 and mask[0] is False
    # with the tiny tokenizer's <s>, the rendered <|begin_of_text|> is text: <s> still comes first
    ids, _ = RowEncoder(tok, spec("messages", template="llama3"))(row)
    assert ids[0] == BOS and tok.decode(ids[:2]).startswith("<s><")


def test_chat_eos_when_template_already_ends_with_it(tok):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    # zephyr ends each turn with the tokenizer's eos: nothing is appended after the final newline
    ids, mask = RowEncoder(tok, spec("messages", template="zephyr"))(row)
    assert ids.count(EOS) == 2 and ids[-1] == enc(tok, "\n")[0] and mask[-1] is False
    assert trained(tok, row, spec("messages", template="zephyr")) == ["yo</s>"]
    # an instruct tokenizer whose eos is the chatml end marker
    t = copy.deepcopy(tok)
    t.add_special_tokens({"eos_token": "<|im_end|>"})
    ids, mask = RowEncoder(t, spec("messages", template="chatml"))(row)
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 2 and EOS not in ids
    assert [text for text, flag in loss_runs(ids, mask, t) if flag] == ["yo<|im_end|>"]


# ---------------------------------------------------------------- conversations

CONV = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "rev abc="},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "up xy="},
    {"role": "assistant", "content": "XY"},
]}

CHATML_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nrev abc=<|im_end|>\n"
               "<|im_start|>assistant\ncba<|im_end|>\n<|im_start|>user\nup xy=<|im_end|>\n"
               "<|im_start|>assistant\nXY<|im_end|>\n")
LLAMA3_TEXT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nrev abc=<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\ncba<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nup xy=<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nXY<|eot_id|>")


def test_builtin_templates_render_like_the_real_ones(tok):
    assert tok.apply_chat_template(CONV["messages"], chat_template=CHAT_TEMPLATES["chatml"], tokenize=False) == (
        CHATML_TEXT)
    assert tok.apply_chat_template(CONV["messages"], chat_template=CHAT_TEMPLATES["llama3"], tokenize=False) == (
        LLAMA3_TEXT)
    assert tok.apply_chat_template(CONV["messages"][:2], chat_template=CHAT_TEMPLATES["zephyr"], tokenize=False,
                                   add_generation_prompt=True) == (
        "<|system|>\nBe brief.</s>\n<|user|>\nrev abc=</s>\n<|assistant|>\n")
    assert tok.apply_chat_template(CONV["messages"][:2], chat_template=CHAT_TEMPLATES["chatml"], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(("template", "train_on", "expected"), [
    # The newline after the last <|im_end|> carries no loss, as after the first; the appended eos does.
    ("chatml", "assistant", ["cba<|im_end|>", "XY<|im_end|>", "</s>"]),
    ("chatml", "completion", ["XY<|im_end|>", "</s>"]),
    ("chatml", "all", [CHATML_TEXT + "</s>"]),
    ("llama3", "assistant", ["cba<|eot_id|>", "XY<|eot_id|></s>"]),
    ("llama3", "completion", ["XY<|eot_id|></s>"]),
    ("llama3", "all", [LLAMA3_TEXT + "</s>"]),
])
def test_chat_loss_on_assistant_turns(tok, template, train_on, expected):
    s = spec("messages", train_on, template=template)
    r = runs(tok, CONV, s)
    full = CHATML_TEXT if template == "chatml" else LLAMA3_TEXT
    # The runs partition the whole example, and exactly the expected pieces carry loss.
    assert "".join(text for text, _ in r) == "<s>" + full + "</s>"
    assert [text for text, flag in r if flag] == expected
    ids, mask = RowEncoder(tok, s)(CONV)
    assert ids[0] == BOS and mask[0] is False and ids[-1] == EOS and mask[-1] is True
    # token positions: the tokens of each trained piece, in order
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [i for piece in expected for i in enc(tok, piece)]


class _NoOffsets:
    """A tokenizer without offset mappings (like a slow, pure-Python one)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._tok(text, **kwargs)


def test_chat_with_a_tokenizer_without_offsets(tok):
    s = spec("messages", template="chatml")
    ids, mask = RowEncoder(_NoOffsets(tok), s)(CONV)
    assert (ids, mask) == RowEncoder(tok, s)(CONV)


def test_chat_without_eos_and_ending_with_user(tok):
    s = spec("messages", template="chatml", add_eos=False)
    assert trained(tok, CONV, s) == ["cba<|im_end|>", "XY<|im_end|>"]
    row = {"messages": CONV["messages"][:4]}
    ids, mask = RowEncoder(tok, spec("messages", template="chatml"))(row)
    assert ids[-1] == EOS and mask[-1] is False  # the eos follows a user turn
    assert trained(tok, row, spec("messages", template="chatml")) == ["cba<|im_end|>"]


def test_chat_assistant_content_with_surrounding_whitespace(tok):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  a b  "}]}
    assert trained(tok, row, spec("messages", template="llama3", add_eos=False)) == ["a b<|eot_id|>"]
    assert trained(tok, row, spec("messages", template="chatml", add_eos=False)) == ["  a b  <|im_end|>"]


def test_chat_tokenizer_template_rendering_bos(tok):
    # A Meta-style template renders {{ bos_token }} itself: no second bos.
    tpl = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[end]{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ids, mask = RowEncoder(tok, spec("messages", template=tpl))(row)
    assert ids.count(BOS) == 1 and ids[0] == BOS
    assert [t for t, f in loss_runs(ids, mask, tok) if f] == ["a[end]</s>"]


def test_chat_template_not_prefix_consistent_falls_back(tok):
    # Earlier assistant turns are rendered differently once a later turn follows (like templates that drop
    # reasoning from old turns): the span is found by the content and the marker after it.
    tpl = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' and not loop.last %}"
           "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}</>{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}")
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "xy"},
                        {"role": "user", "content": "r"}, {"role": "assistant", "content": "zw"}]}
    s = spec("messages", "completion", template=tpl, add_eos=False)
    assert trained(tok, row, s) == ["zw</>"]
    with pytest.raises(BadRow, match="not prefix-consistent"):
        RowEncoder(tok, spec("messages", "assistant", template=tpl))(row)


def test_chat_opening_with_assistant(tok):
    row = {"messages": [{"role": "assistant", "content": "Hello, how can I help?"},
                        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    assert trained(tok, row, spec("messages", template="chatml", add_eos=False)) == [
        "Hello, how can I help?<|im_end|>", "ok<|im_end|>"]


def test_messages_as_json_string_and_null_keys(tok):
    row = {"messages": '[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]'}
    assert trained(tok, row, spec("messages", template="chatml")) == ["a<|im_end|>", "</s>"]
    row = {"messages": [{"role": "user", "content": "q", "name": None},
                        {"role": "assistant", "content": "a", "tool_calls": None}]}
    assert trained(tok, row, spec("messages", template="chatml")) == ["a<|im_end|>", "</s>"]


# ---------------------------------------------------------------- bad rows


@pytest.mark.parametrize(("fmt", "row", "reason"), [
    ("text", {"txt": "a"}, "missing field 'text'"),
    ("text", {"text": 3}, "field 'text' must be a string, got int"),
    ("text", {"text": "  "}, "field 'text' is empty"),
    ("text", {"text": None}, "field 'text' is null"),
    ("prompt_completion", {"prompt": "a"}, "missing field 'completion'"),
    ("prompt_completion", {"prompt": "a", "completion": ""}, "field 'completion' is empty"),
    ("prompt_completion", {"prompt": ["a"], "completion": "b"}, "field 'prompt' must be a string, got list"),
    ("alpaca", {"instruction": "i"}, "missing field 'output'"),
    ("alpaca", {"instruction": "i", "input": 3, "output": "o"}, "field 'input' must be a string, got int"),
    ("messages", {"text": "a"}, "missing field 'messages'"),
    ("messages", {"messages": "hello"}, "must be a list of {role, content} messages, got str"),
    ("messages", {"messages": "[not json"}, "is a string but not a JSON list"),
    ("messages", {"messages": []}, "empty conversation"),
    ("messages", {"messages": ["hi"]}, "message 0 must be an object with 'role' and 'content', got str"),
    ("messages", {"messages": [{"content": "hi"}]}, "message 0 has no 'role'"),
    ("messages", {"messages": [{"role": 1, "content": "hi"}]}, "message 0: role must be a non-empty string"),
    ("messages", {"messages": [{"role": "user"}]}, r"message 0 \(user\) has no 'content'"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     r"message 0 \(user\): content must be a string, got list"),
    ("messages", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ("messages", {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "a"}]},
     r"unknown role 'robot' \(the chatml template knows system, user, assistant\)"),
    ("messages", {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "a"}]},
     "unknown role 'tool'"),
])
def test_bad_rows(tok, fmt, row, reason):
    with pytest.raises(BadRow, match=reason) as info:
        RowEncoder(tok, spec(fmt, template="chatml"))(row)
    assert "\n" not in str(info.value)


def test_lone_surrogate_is_a_bad_row(tok):
    row = json.loads('{"text": "a\\ud800b", "messages": [{"role": "user", "content": "x\\udc00"}, '
                     '{"role": "assistant", "content": "y"}]}')
    for s in (spec("text"), spec("messages", template="chatml")):
        with pytest.raises(BadRow, match="unpaired surrogate"):
            RowEncoder(tok, s)(row)


def test_bad_row_names_mapped_column(tok):
    with pytest.raises(BadRow, match=r"missing field 'answer' \(completion\)"):
        RowEncoder(tok, spec("prompt_completion", prompt="question", completion="answer"))({"question": "q"})


def test_bad_rows_from_templates(tok):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    strict = "{% for m in messages %}{% if m['role'] == 'user' %}{{ raise_exception('roles must alternate') }}" \
             "{% endif %}{% endfor %}"
    with pytest.raises(BadRow, match="chat template error: roles must alternate"):
        RowEncoder(tok, spec("messages", template=strict))(row)
    broken = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(BadRow, match="chat template error: TypeError"):
        RowEncoder(tok, spec("messages", template=broken))(row)
    llama = spec("messages", template="llama3")
    with pytest.raises(BadRow, match="unknown role 'robot'"):
        RowEncoder(tok, llama)({"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]})


def test_train_on_all_needs_no_assistant(tok):
    row = {"messages": [{"role": "user", "content": "just text"}]}
    ids, mask = RowEncoder(tok, spec("messages", "all", template="chatml"))(row)
    assert mask == [False] + [True] * (len(ids) - 1)


# ---------------------------------------------------------------- pickling, fingerprints, rendering


def test_row_encoder_pickles(tok):
    t = copy.deepcopy(tok)
    t.pad_token = t.eos_token  # state set after loading travels too
    for s, row in [(spec("messages", template="llama3"), CONV),
                   (spec("prompt_completion", prompt="q", completion="a"), {"q": "1+1=", "a": "2"})]:
        encoder = RowEncoder(t, s)
        clone = pickle.loads(pickle.dumps(encoder))
        assert clone.spec == s and clone.tokenizer.pad_token_id == EOS
        assert clone(row) == encoder(row)


def test_render_spec_fingerprint_and_validation():
    a = spec("messages", template="chatml")
    assert a.fingerprint() == spec("messages", template="chatml").fingerprint()
    assert hash(a) == hash(spec("messages", template="chatml"))
    others = [spec("messages", template="llama3"), spec("messages", "all", template="chatml"),
              spec("messages", add_eos=False, template="chatml"), spec("messages", template="chatml", messages="conv")]
    assert len({a.fingerprint(), *(o.fingerprint() for o in others)}) == 5
    with pytest.raises(ValueError, match="format"):
        RenderSpec("auto", {})
    with pytest.raises(ValueError, match="train_on"):
        RenderSpec("text", {}, None, "prompt")
    with pytest.raises(ValueError, match="chat_template"):
        RenderSpec("messages", {})
    src = SourceConfig(path="x", fields={"prompt": "q"})
    s = RenderSpec.for_source("prompt_completion", src, CHAT_TEMPLATES["chatml"], "all", False)
    assert s == RenderSpec("prompt_completion", {"prompt": "q", "completion": "completion"}, None, "all", False)


def test_tokenizer_fingerprint(tok):
    a = tokenizer_fingerprint(tok)
    assert a == tokenizer_fingerprint(load_tokenizer(None))
    t = copy.deepcopy(tok)
    t.chat_template = CHAT_TEMPLATES["chatml"]
    assert tokenizer_fingerprint(t) != a
    t = copy.deepcopy(tok)
    t.add_special_tokens({"eos_token": "<|im_end|>"})
    assert tokenizer_fingerprint(t) != a


def test_loss_runs_and_render_example(tok):
    s = spec("prompt_completion")
    row = {"prompt": "cp ab=", "completion": "ab"}
    ids, mask = RowEncoder(tok, s)(row)
    assert loss_runs(ids, mask, tok) == [("<s>cp ab=", False), ("ab</s>", True)]
    assert render_example(row, s, tok) == "<s>cp ab=⟦ab</s>⟧"
    assert loss_runs([], [], tok) == []
    with pytest.raises(ValueError):
        loss_runs([1, 2], [True], tok)
    with pytest.raises(BadRow):
        render_example({"prompt": "x"}, s, tok)


# ---------------------------------------------------------------- choosing the template


def test_resolve_chat_template_choices(tok, tmp_path):
    assert resolve_chat_template("auto", tok) == (CHAT_TEMPLATES["chatml"], "chatml (tokenizer has none)")
    for name in ("chatml", "llama3", "zephyr"):
        assert resolve_chat_template(name, tok) == (CHAT_TEMPLATES[name], name)
    with pytest.raises(ShardtuneError, match="tokenizer has no chat template"):
        resolve_chat_template("tokenizer", tok)
    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_chat_template("auto", t) == (t.chat_template, "tokenizer's chat template")
    assert resolve_chat_template("tokenizer", t)[0] == t.chat_template
    f = tmp_path / "mine.jinja"
    f.write_text(CHAT_TEMPLATES["zephyr"])
    assert resolve_chat_template(str(f), tok) == (CHAT_TEMPLATES["zephyr"], str(f))


def test_resolve_chat_template_errors(tok, tmp_path):
    with pytest.raises(ShardtuneError, match=r"'vicuna' is not a template; choose auto, tokenizer, chatml, llama3, "
                                             r"zephyr or a path to a \.jinja file") as info:
        resolve_chat_template("vicuna", tok)
    assert "\n" not in str(info.value)
    with pytest.raises(ShardtuneError, match="does not exist"):
        resolve_chat_template(str(tmp_path / "missing.jinja"), tok)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ShardtuneError, match="is not valid Jinja"):
        resolve_chat_template(str(bad), tok)
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ShardtuneError, match="is empty"):
        resolve_chat_template(str(empty), tok)
