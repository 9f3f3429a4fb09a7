"""A method's step event reads as one line: the first entry, then the others in brackets, with
numbers as a person writes them (not a Python dict's repr); such internal lines reach a
terminal only under --verbose."""

from __future__ import annotations

import io

import pytest

from harness.trials.events import event_text, number_text, say_event


def test_qgalore_svd_event_is_one_readable_line() -> None:
    """The keys Q-GaLore's on_step returns (methods/qgalore.py, qgalore_optim.svd_stats)."""
    events = {"qgalore_svd": 3, "svd_total": 1234, "svd_skipped": 2, "gap_mean": 17.333333,
              "svd_retries": 0, "svd_failures": 0}
    assert event_text(events) == ("qgalore_svd 3 (svd_total 1,234, svd_skipped 2, "
                                  "gap_mean 17.33, svd_retries 0, svd_failures 0)")


def test_relora_merge_event_keeps_its_words() -> None:
    events = {"relora_merge": 2, "optimizer_reset": "prune 0.999", "moments_zeroed": 1048576}
    assert event_text(events) == ("relora_merge 2 (optimizer_reset prune 0.999, "
                                  "moments_zeroed 1,048,576)")


def test_a_single_entry_has_no_brackets_and_nothing_prints_nothing() -> None:
    assert event_text({"warm_start": "done"}) == "warm_start done"
    assert event_text({}) == ""


def test_numbers_as_a_person_writes_them() -> None:
    assert number_text(15.0) == "15"  # a whole mean gap, not 15.0
    assert number_text(0.000123456) == "0.0001235"
    assert number_text(2.5e7) == "2.5e+07"
    assert number_text(float("nan")) == "nan"
    assert number_text(True) == "yes" and number_text(False) == "no"  # not 1 / 0
    assert number_text(-7) == "-7"


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("verbose", "tty", "stdout", "stderr"), [
    ("1", True, "threads: 2\n", ""),  # --verbose: on the terminal
    ("0", False, "", "threads: 2\n"),  # stderr is a log (a sweep trial's stderr.log): there
    ("0", True, "", ""),  # a terminal without --verbose: not shown (summary.json has it)
])  # fmt: skip
def test_an_internal_line_reaches_a_terminal_only_under_verbose(monkeypatch, verbose, tty,
                                                                 stdout, stderr) -> None:
    out, err = Stream(tty), Stream(tty)
    monkeypatch.setenv("HARNESS_VERBOSE", verbose)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    say_event("threads: 2")
    assert (out.getvalue(), err.getvalue()) == (stdout, stderr)
