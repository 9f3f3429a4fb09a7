"""`c4_sample_choice`, the downstream task that runs offline: which of four continuations
follows a passage of the embedded sample corpus's validation split (harness/data/sample),
scored as lm-evaluation-harness scores HellaSwag (the log-likelihood of each ending, `acc`
and the length-normalized `acc_norm`).

Built deterministically: each validation document is cut into windows of `CONTEXT` words
followed by `ENDING` words, one window every `STRIDE` words; the wrong endings are those of the
examples a quarter, a half and three quarters of the list away (other documents, mostly), and
the right one's position cycles through the four. Built when lm-eval loads the task, not
shipped: the data file would count twice against a device call's carry (docs/gpu_kit.md).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from harness.data.c4 import SAMPLE

TASKS = Path(__file__).parent / "tasks"  # the task YAMLs lm-eval reads, and their data
NAME = "c4_sample_choice"
VALIDATION = SAMPLE / "c4-validation.00000-of-00001.json.gz"
CONTEXT, ENDING, STRIDE, CHOICES = 48, 12, 200, 4


def windows(text: str) -> list[tuple[str, str]]:
    """(context, ending) word windows of one document, `STRIDE` words apart."""
    words = text.split()
    return [(" ".join(words[i:i + CONTEXT]), " ".join(words[i + CONTEXT:i + CONTEXT + ENDING]))
            for i in range(0, len(words) - CONTEXT - ENDING + 1, STRIDE)]


def examples() -> list[dict[str, Any]]:
    """The task's examples, in document order: context, four endings, the right one's index."""
    with gzip.open(VALIDATION, "rt", encoding="utf-8") as f:
        pairs = [pair for line in f for pair in windows(json.loads(line)["text"])]
    n = len(pairs)
    rows = []
    for i, (context, ending) in enumerate(pairs):
        wrong = [pairs[(i + k * n // CHOICES) % n][1] for k in range(1, CHOICES)]
        label = i % CHOICES
        rows.append({"id": i, "context": context,
                     "endings": [*wrong[:label], ending, *wrong[label:]], "label": label})
    return rows


def dataset(**_: Any) -> Any:
    """The examples as lm-eval's `custom_dataset` gives them (its task metadata is passed as
    keywords and not needed)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(examples())})
