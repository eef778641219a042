"""Types shared by the data stages: reading rows, encoding them, caching the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RowItem:
    """One row as a source yields it.

    where: "path:line" (1-based line) or "path#index" for row-indexed formats; used in messages.
    row:   the row's fields, or None when the row could not be read.
    error: why it could not be read (invalid JSON, invalid UTF-8, not an object), else None.
    """

    where: str
    row: dict[str, Any] | None
    error: str | None = None


class BadRow(ValueError):
    """A row that cannot become a training example. str(err) is a short reason such as
    "missing field 'completion'" or "unknown role 'robot'"; the caller adds the row's location."""
