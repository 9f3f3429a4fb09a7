"""`harness eval`: downstream scores of trials' final models with lm-evaluation-harness
(run.py), the offline task built from the sample corpus (sample_task.py, tasks/), and each
trial's `eval.json` (store.py). Only what the command line's parser needs is here: building
it imports neither torch nor lm-eval."""

from __future__ import annotations

import argparse

DEFAULT_TASKS = ("hellaswag", "arc_easy", "piqa", "winogrande", "lambada")


def task_list(text: str) -> list[str]:
    """`--tasks a,b`: the names, in order, each once."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected task names separated by commas, got '{text}'")
    return names


def batch_size(text: str) -> int | str:
    """`--batch-size`: a whole number, or `auto` (lm-eval finds the largest that fits)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1 or 'auto', "
                                         f"got '{text}'")
    return int(text)
