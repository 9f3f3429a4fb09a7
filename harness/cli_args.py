"""The `harness` command's argument parsing: its exit statuses, a parser whose bad flag is one
line like every other user error, the value types its flags take, and `--json`'s clean
stdout."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from typing import NoReturn

EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_INTERRUPTED = 0, 1, 2, 130


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (and exit 2), like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got '{text}'")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got '{text}'")
    return value


def rank_and_micro(text: str) -> tuple[int, int]:
    rank, _, micro = text.partition(":")
    if not (rank.isdigit() and micro.isdigit() and int(rank) > 0 and int(micro) > 0):
        raise argparse.ArgumentTypeError(f"expected RANK:MICRO, two whole numbers of at least 1 "
                                         f"(e.g. 64:4), got '{text}'")
    return int(rank), int(micro)


@contextmanager
def logs_to_stderr(active: bool) -> Iterator[None]:
    """Under --json stdout carries the JSON alone, for `| jq`: meanwhile progress lines, child
    processes and C libraries write to stderr (file descriptor 1 itself is pointed there)."""
    if not active:
        yield
        return
    stdout = sys.stdout
    stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        stdout.flush()  # whatever a library wrote to the old stream goes to stderr too
        os.dup2(saved, 1)
        os.close(saved)
