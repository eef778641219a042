"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class ShardtuneError(Exception):
    """A problem with the user's input (config, files, model): actionable, no traceback."""


class ConfigError(ShardtuneError):
    """A config key, type or value that is not allowed."""
