"""GLUE data and metrics: hand-computed metric values, GLUE-schema local files, the embedded
task, and clear errors for what cannot be read."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from harness.data.glue import TASKS, compute_metrics, get_task, load_split, sample_examples
from harness.errors import UserError


def test_classification_metrics_by_hand():
    predictions, labels = np.array([1, 0, 1, 1, 0, 0]), np.array([1, 0, 0, 1, 1, 0])
    # TP 2, TN 2, FP 1, FN 1: precision = recall = 2/3, F1 2/3, accuracy 4/6
    # MCC = (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (4 − 1) / sqrt(81) = 1/3
    mrpc = compute_metrics(get_task("mrpc"), predictions, labels)
    assert mrpc["f1"] == pytest.approx(200 / 3) and mrpc["accuracy"] == pytest.approx(200 / 3)
    assert mrpc["score"] == pytest.approx(200 / 3)
    cola = compute_metrics(get_task("cola"), predictions, labels)
    assert cola == pytest.approx({"matthews": 100 / 3, "score": 100 / 3})
    mnli = compute_metrics(get_task("mnli"), np.array([0, 1, 2, 2]), np.array([0, 1, 2, 0]))
    assert mnli == {"accuracy": 75.0, "score": 75.0}


def test_regression_metrics_by_hand():
    scores, gold = np.array([1.0, 2.0, 3.5, 4.0]), np.array([1.0, 2.5, 3.0, 4.0])
    x, y = scores - scores.mean(), gold - gold.mean()
    pearson = (x @ y) / math.sqrt((x @ x) * (y @ y))
    # ranks: scores 1,2,3,4 and gold 1,2,3,4: a perfect monotone relation
    stsb = compute_metrics(get_task("stsb"), scores, gold)
    assert stsb["pearson"] == pytest.approx(100 * pearson)
    assert stsb["spearman"] == pytest.approx(100.0)
    assert stsb["score"] == pytest.approx((100 * pearson + 100) / 2)


@pytest.mark.parametrize("ext", [".tsv", ".csv", ".jsonl", ".parquet"])
def test_local_files_in_glue_schema(tmp_path, ext):
    rows = [{"sentence1": f"a {i}", "sentence2": f"b {i}", "label": i % 2, "idx": i}
            for i in range(5)]
    frame = pd.DataFrame(rows)
    path = tmp_path / f"validation{ext}"
    if ext == ".parquet":
        frame.to_parquet(path)
    elif ext == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        frame.to_csv(path, sep="\t" if ext == ".tsv" else ",", index=False)
    data = load_split(get_task("rte"), str(tmp_path), "validation")
    assert data.column_names == ["sentence1", "sentence2", "label"]
    assert data[3] == {"sentence1": "a 3", "sentence2": "b 3", "label": 1}


def test_local_file_errors_name_what_is_missing(tmp_path):
    pd.DataFrame([{"sentence": "x", "label": 0}]).to_csv(tmp_path / "train.csv", index=False)
    with pytest.raises(UserError, match=r"rte train has no column sentence1, sentence2 \(GLUE"):
        load_split(get_task("rte"), str(tmp_path), "train")
    with pytest.raises(UserError, match=r"no validation file in .* validation\.tsv, "):
        load_split(get_task("cola"), str(tmp_path), "validation")
    with pytest.raises(UserError, match=r"unknown GLUE task 'cola2' .*allowed: cola, sst2"):
        get_task("cola2")


def test_hub_unreachable_is_one_clear_line():
    with pytest.raises(UserError, match=r"task.dataset: 'nyu-mll/glue/cola' is not in the local "
                       r"Hugging Face cache and the hub cannot be reached \(offline: "):
        load_split(get_task("cola"), "hub", "validation")


def test_embedded_task_is_balanced_deterministic_and_offline():
    train, again = sample_examples("train"), sample_examples("train")
    assert train == again and len(train) == 2000
    assert sum(e["label"] for e in train) == 1000
    validation = sample_examples("validation")
    assert len(validation) == 400
    assert not {e["sentence"] for e in validation} & {e["sentence"] for e in train}
    shuffled, original = validation[0], validation[1]
    assert shuffled["label"] == 0 and original["label"] == 1
    data = load_split(TASKS["sample"], "sample", "validation")
    assert data.num_rows == 400 and data.column_names == ["sentence", "label"]


def test_shuffled_sentences_keep_their_words():
    train = sample_examples("train", count=200)
    import random

    from harness.data.glue import _shuffle_locally

    for example in train[1::2]:
        words = example["sentence"].split()
        shuffled = _shuffle_locally(words, random.Random(0))
        assert (sorted(shuffled) == sorted(words) and shuffled != words) or words[0] == words[1]
