"""GLUE: the eight tasks in the schema of the hub's `nyu-mll/glue`, their metrics as GLUE defines
them, and an embedded acceptability task that makes fine-tuning runnable offline.

A task reads from the hub (`source: hub`) or from a local folder holding one file per split,
named after it (`train.tsv`, `validation.jsonl`, …; tsv, csv, jsonl/json or parquet), with
the same columns as the hub's: the task's text columns and `label` (a float for STS-B).
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.config.hub import not_cached, offline
from harness.data.c4 import SAMPLE
from harness.errors import UserError, brief

HUB = "nyu-mll/glue"
FORMATS = {".tsv": "csv", ".csv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class GlueTask:
    name: str
    columns: tuple[str, ...]  # the text fields, one or a pair
    num_labels: int  # 1: regression (STS-B)
    metrics: tuple[str, ...]  # the task's GLUE metrics; their mean is its GLUE score
    validation: tuple[str, ...] = ("validation",)  # MNLI: matched and mismatched


TASKS: dict[str, GlueTask] = {
    "cola": GlueTask("cola", ("sentence",), 2, ("matthews",)),
    "sst2": GlueTask("sst2", ("sentence",), 2, ("accuracy",)),
    "mrpc": GlueTask("mrpc", ("sentence1", "sentence2"), 2, ("f1", "accuracy")),
    "stsb": GlueTask("stsb", ("sentence1", "sentence2"), 1, ("pearson", "spearman")),
    "qqp": GlueTask("qqp", ("question1", "question2"), 2, ("f1", "accuracy")),
    "mnli": GlueTask("mnli", ("premise", "hypothesis"), 3, ("accuracy",),
                     ("validation_matched", "validation_mismatched")),
    "qnli": GlueTask("qnli", ("question", "sentence"), 2, ("accuracy",)),
    "rte": GlueTask("rte", ("sentence1", "sentence2"), 2, ("accuracy",)),
    # Embedded: a sentence of the sample corpus (1) or the same words locally shuffled (0).
    "sample": GlueTask("sample", ("sentence",), 2, ("accuracy", "matthews")),
}


def get_task(name: str) -> GlueTask:
    if name not in TASKS:
        raise UserError(f"task.glue_task: unknown GLUE task '{name}' "
                        f"(allowed: {', '.join(TASKS)})")
    return TASKS[name]


def compute_metrics(
    task: GlueTask, predictions: np.ndarray, labels: np.ndarray
) -> dict[str, float]:
    """The task's metrics on the validation predictions (class ids, or scores for STS-B), as
    percentages like the GLUE leaderboard, plus `score`: their mean."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    functions = {
        "accuracy": lambda p, y: accuracy_score(y, p),
        "f1": lambda p, y: f1_score(y, p),
        "matthews": lambda p, y: matthews_corrcoef(y, p),
        "pearson": lambda p, y: pearsonr(p, y)[0],
        "spearman": lambda p, y: spearmanr(p, y)[0],
    }
    values = {m: 100 * float(functions[m](predictions, labels)) for m in task.metrics}
    return {**values, "score": sum(values.values()) / len(values)}


def load_split(task: GlueTask, source: str, split: str) -> Any:
    """A `datasets.Dataset` with the task's text columns and `label`."""
    from datasets import load_dataset

    if task.name == "sample":
        from datasets import Dataset

        return Dataset.from_list(sample_examples(split))
    if source == "hub":
        _check_reachable(task)
        try:
            data = load_dataset(HUB, task.name, split=split)
        except Exception as e:  # no network, unknown split: the user must point at local files
            reason = brief(e)
            raise UserError(f"task.dataset: cannot load {HUB}/{task.name} {split} ({reason}); "
                            "set task.dataset to a folder of GLUE-schema files") from None
    else:
        path = _split_file(Path(source).expanduser(), split)
        extra = {"delimiter": "\t"} if path.suffix == ".tsv" else {}
        data = load_dataset(FORMATS[path.suffix], data_files=str(path), split="train", **extra)
    missing = [c for c in (*task.columns, "label") if c not in data.column_names]
    if missing:
        raise UserError(f"task.dataset: {task.name} {split} has no column {', '.join(missing)} "
                        f"(GLUE schema for {task.name}: {', '.join(task.columns)}, label)")
    return data.select_columns([*task.columns, "label"])


def _check_reachable(task: GlueTask) -> None:
    """Offline, a task `datasets` has not cached (its arrow files) is one line at once, not
    tens of seconds of retries; a cached one loads from there."""
    from datasets import config

    reason = offline()
    cached = Path(config.HF_DATASETS_CACHE) / HUB.replace("/", "___") / task.name
    if reason and not cached.is_dir():
        raise not_cached("task.dataset", f"{HUB}/{task.name}", reason,
                         "set task.dataset to a folder of GLUE-schema files, or glue_task: "
                         "sample (the embedded task)")


def _split_file(folder: Path, split: str) -> Path:
    found = [folder / f"{split}{ext}" for ext in FORMATS if (folder / f"{split}{ext}").is_file()]
    if not found:
        names = ", ".join(f"{split}{ext}" for ext in FORMATS)
        raise UserError(f"task.dataset: no {split} file in {folder} (expected one of {names})")
    return found[0]


def sample_examples(split: str, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The embedded task, deterministic: sentences of 8-30 words from the sample corpus's
    `split` documents, every other one with each word pair in a random half of its positions
    swapped (local shuffles keep the words, break the grammar)."""
    count = count or (2000 if split == "train" else 400)
    rng = random.Random(f"{seed}-{split}")
    examples: list[dict[str, Any]] = []
    with gzip.open(SAMPLE / f"c4-{split}.00000-of-00001.json.gz", "rt") as f:
        for line in f:
            for sentence in re.split(r"(?<=[.!?])\s+", json.loads(line)["text"]):
                words = sentence.split()
                if not 8 <= len(words) <= 30:
                    continue
                label = len(examples) % 2
                text = " ".join(words if label else _shuffle_locally(words, rng))
                examples.append({"sentence": text, "label": label})
                if len(examples) == count:
                    return examples
    raise UserError(f"the sample corpus's {split} split holds fewer than {count} sentences")


def _shuffle_locally(words: list[str], rng: random.Random) -> list[str]:
    words = list(words)
    for i in range(0, len(words) - 1, 2):
        if rng.random() < 0.5 or i == 0:  # the first pair always: never the original order
            words[i], words[i + 1] = words[i + 1], words[i]
    return words
