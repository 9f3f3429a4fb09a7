"""harness/errors.py: the one-line messages every command prints."""

from __future__ import annotations

import pytest

from harness.errors import UserError, first_line, last_line, render, suggest


def test_suggest_names_the_path_the_closest_choice_and_all_allowed():
    error = suggest("galor", ["full", "galore", "lora"], "method", "methods.x.name")
    assert isinstance(error, UserError)
    assert str(error) == ("methods.x.name: unknown method 'galor' (did you mean 'galore'? "
                          "allowed: full, galore, lora)")


def test_suggest_without_a_close_choice_only_lists_the_allowed():
    error = suggest("zzz", ["full", "galore"], "model preset", "model")
    assert str(error) == "model: unknown model preset 'zzz' (allowed: full, galore)"
    assert "did you mean" not in str(error)


def test_render_prefixes_error_and_keeps_one_line():
    line = render(UserError("train.lr: 'fast' is invalid"))
    assert line == "error: train.lr: 'fast' is invalid"
    assert "\n" not in line


@pytest.mark.parametrize(
    ("error", "first", "last"),
    [
        (RuntimeError("boom"), "boom", "boom"),
        (RuntimeError("  \nTraceback (most recent call last):\n  File x\nValueError: bad\n"),
         "Traceback (most recent call last):", "ValueError: bad"),
        (KeyError(), "KeyError", "KeyError"),  # no message: the type's name
        (ValueError("   "), "ValueError", "ValueError"),
    ],
)
def test_first_and_last_line(error, first, last):
    assert first_line(error) == first
    assert last_line(error) == last
