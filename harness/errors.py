"""The user-facing error types and the one-line formatting, used by every command.

A mistake in the input is a UserError: one line on stderr (`render`) and exit code 2. A failure
recorded in a summary or printed by a launcher is its exception's `first_line` or `last_line`.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2. The message is made one
    line here, once for every raiser: a key or value quoted from the user's file may hold a
    newline or another control character, shown escaped (`'a\\nb'`)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def one_line(text: str) -> str:
    """`text` with every unprintable character (newline, tab, NUL, U+2028...) escaped as Python
    writes it, printable ones (é, spaces) as they are."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def suggest(name: str, choices: list[str], what: str, path: str) -> UserError:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UserError(f"{path}: unknown {what} '{name}' ({hint}allowed: {', '.join(choices)})")


def render(error: UserError) -> str:
    """How a command prints a user error on stderr (without the newline)."""
    return f"error: {error}"


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def brief(error: BaseException) -> str:
    """The first line cut to fit inside another one-line message (a hub or loader error's
    first line can be a whole response body)."""
    return first_line(error)[:160]


def last_line(error: BaseException) -> str:
    """The last line: a launcher's job errors carry the job's whole traceback, its end says
    why."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]
