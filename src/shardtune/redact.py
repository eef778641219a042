"""Secrets out of what a run writes or shows: the credentials of every URL in the config (user:password@, query
parameters named like token, key, secret, password or signature) and the values of secret-named environment
variables (WANDB_API_KEY, HF_TOKEN, MLFLOW_TRACKING_PASSWORD, ...) are masked before the config is logged to a
tracker, saved (config.yaml, a checkpoint's trainer_state.json) or shown (the report). The run itself uses the
values as given."""

from __future__ import annotations

import os
import re
from typing import Any

MASK = "***"
# A URL in free text (YAML, an error message) runs to the next space or quote. Its userinfo is what precedes the
# last '@' before the path: a password with an unescaped '@' in it is still masked whole.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
_SECRET_PARAM = re.compile(r"(?P<name>[?&;][^=&;#]*(?:token|key|secret|passw|pwd|credential|signature|sig|auth)"
                           r"[^=&;#]*=)[^&;#]*", re.IGNORECASE)
_SECRET_ENV = re.compile(r"TOKEN|API_KEY|ACCESS_KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Shorter values (a flag such as SOME_TOKEN=1) would mask every such character string in the config.
_MIN_SECRET_LEN = 8


def _secret_env_values() -> list[str]:
    """The values of secret-named environment variables, longest first (read at each call: env may change)."""
    values = {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def _redact_url(url: str) -> str:
    url = _USERINFO.sub(lambda m: m["scheme"] + MASK + "@", url, count=1)
    return _SECRET_PARAM.sub(lambda m: m["name"] + MASK, url)


def redact_text(text: str) -> str:
    """`text` with the credentials of every URL in it and every secret environment variable's value masked."""
    text = _URL.sub(lambda m: _redact_url(m[0]), text)
    for value in _secret_env_values():
        text = text.replace(value, MASK)
    return text


def redact(value: Any) -> Any:
    """A copy of a JSON-like config (dicts, lists, strings) with `redact_text` applied to every string."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value
