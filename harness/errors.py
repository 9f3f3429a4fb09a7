"""User-facing errors: a mistake in the input is one line on stderr and exit code 2."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2."""


def suggest(name: str, choices: list[str], what: str, path: str) -> UserError:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UserError(f"{path}: unknown {what} '{name}' ({hint}allowed: {', '.join(choices)})")


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def last_line(error: BaseException) -> str:
    """The last line: submitit's errors carry the job's whole traceback, its end says why."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]
