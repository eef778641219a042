"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

from collections.abc import Iterator


class ShardtuneError(Exception):
    """A problem with the user's input (config, files, model): actionable, no traceback."""


class ConfigError(ShardtuneError):
    """A config key, type or value that is not allowed."""


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and every error it was raised from or during (__cause__, __context__), each once: libraries wrap the
    error that says what happened (torch's zip writer, DCP, gloo)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
