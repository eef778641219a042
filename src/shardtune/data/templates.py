"""Built-in chat templates and the choice of the template a run renders conversations with.

The built-ins are Jinja sources in the form transformers' ``apply_chat_template`` renders (its sandboxed
environment with ``trim_blocks``/``lstrip_blocks`` and ``raise_exception``). They know the roles system,
user and assistant and raise "unknown role ..." for any other, so a row with such a role becomes a bad row
instead of silently losing a message. Each is prefix-consistent: rendering the first k messages gives a
prefix of rendering all of them, and ``add_generation_prompt`` appends exactly the header an assistant
message starts with; the loss mask relies on that (see ``formats.RowEncoder``).

* ``chatml``: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; generation prompt ``<|im_start|>assistant\\n``.
* ``llama3``: ``<|begin_of_text|>`` once, then ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>``
  (content trimmed, as Meta's template does); generation prompt ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``.
  Unlike Meta's template it writes ``<|begin_of_text|>`` literally and also for an empty conversation, so
  the begin-of-text marker is there whatever the tokenizer's bos token is.
* ``zephyr``: ``<|ROLE|>\\nCONTENT</s>\\n`` with the tokenizer's eos token as the end marker (``</s>`` when it
  has none); generation prompt ``<|assistant|>\\n`` (Zephyr's own ends at ``<|assistant|>``; the newline is
  part of the prompt here so that no prompt character counts as the assistant's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtune.errors import ShardtuneError

_ROLE_CHECK = (
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception(\"unknown role '\" ~ message['role'] ~ \"' (the NAME template knows system, user, "
    "assistant)\") -}}"
    "{%- endif -%}"
)

CHATML = (
    "{%- for message in messages -%}"
    + _ROLE_CHECK.replace("NAME", "chatml")
    + "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    + _ROLE_CHECK.replace("NAME", "llama3")
    + "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

ZEPHYR = (
    "{%- set eos = eos_token if eos_token is defined and eos_token else '</s>' -%}"
    "{%- for message in messages -%}"
    + _ROLE_CHECK.replace("NAME", "zephyr")
    + "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

CHAT_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR}
CHOICES = "auto, tokenizer, " + ", ".join(CHAT_TEMPLATES) + " or a path to a .jinja file"


def tokenizer_chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template (its ``default`` one when it has several by name), or None."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def _check_syntax(source: str, label: str, tokenizer: Any) -> None:
    """Compile the template once (through transformers, which adds its own tags) so a typo fails early."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=source, tokenize=False)
    except TemplateSyntaxError as err:
        raise ShardtuneError(f"data.chat_template: {label} is not valid Jinja (line {err.lineno}: "
                             f"{err.message})") from None
    except Exception:  # runtime errors depend on the conversation; each bad row reports its own
        pass


def resolve_chat_template(name: str, tokenizer: Any) -> tuple[str, str]:
    """(Jinja source, label for reports) of ``data.chat_template``.

    ``auto``: the tokenizer's template, else ``chatml`` (label ``"chatml (tokenizer has none)"``).
    ``tokenizer``: the tokenizer's template, or ShardtuneError when it has none.
    ``chatml`` / ``llama3`` / ``zephyr``: the built-in. A path to a ``.jinja`` file (or any existing file):
    its text. Anything else raises ShardtuneError listing the choices.
    """
    own = tokenizer_chat_template(tokenizer)
    if name == "auto":
        return (own, "tokenizer's chat template") if own else (CHAT_TEMPLATES["chatml"], "chatml (tokenizer has none)")
    if name == "tokenizer":
        if own is None:
            raise ShardtuneError("data.chat_template: 'tokenizer' but the tokenizer has no chat template; "
                                 f"choose one of {', '.join(CHAT_TEMPLATES)} or a .jinja file")
        return own, "tokenizer's chat template"
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name], name
    p = Path(name).expanduser()
    if p.is_file():
        try:
            source = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ShardtuneError(f"data.chat_template: cannot read {name!r} ({err})") from None
        if not source.strip():
            raise ShardtuneError(f"data.chat_template: {name!r} is empty")
        _check_syntax(source, repr(name), tokenizer)
        return source, str(p)
    if name.endswith(".jinja"):
        raise ShardtuneError(f"data.chat_template: file {name!r} does not exist")
    raise ShardtuneError(f"data.chat_template: {name!r} is not a template; choose {CHOICES}")
