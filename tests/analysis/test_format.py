"""analysis/format.py: the cells, order and variant names every table and figure share."""

from __future__ import annotations

import math

import pandas as pd

from harness.analysis.format import (
    VARIANT_DEFAULTS,
    cell,
    fill_variants,
    ordered,
    text_table,
    variant_label,
)


def test_text_table_keeps_preformatted_numbers_and_blanks_missing_cells():
    table = pd.DataFrame({"method": ["full", "galore"], "lr": ["0.0010", None],
                          "tok/s": ["1,257", "01"]})
    text = text_table(table)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["method", "lr", "tok/s"]
    assert "| full     | 0.0010 | 1,257   |" in lines  # not re-parsed into 0.001 or 1257
    assert "| galore   |        | 01      |" in lines
    assert "nan" not in text and "None" not in text


def test_ordered_puts_the_sweeps_order_first_then_the_rest_alphabetically():
    labels = pd.Series(["lora", "full", "adam8bit", "galore", "full"])
    assert ordered(labels, ["galore", "missing", "full"]) == ["galore", "full", "adam8bit", "lora"]
    assert ordered(labels, []) == ["adam8bit", "full", "galore", "lora"]


def test_cell_formats_numbers_and_blanks_missing_ones():
    assert cell(1234.5678, ",.0f") == "1,235"
    assert cell(0.36, ".2f", " GB") == "0.36 GB"
    assert cell(None, ".2f") == "" and cell(math.nan, ".2f", " GB") == ""
    assert cell(pd.NA, "d") == ""


def test_variants_are_filled_with_defaults_and_named_only_where_they_differ():
    trials = pd.DataFrame({"method": ["full", None], "memory": [None, "recompute full"],
                           "precision": ["bf16-mixed", None], "lr": [1.0, 2.0]})
    filled = fill_variants(trials)
    assert filled[list(VARIANT_DEFAULTS)].values.tolist() == [
        ["full", "none", "bf16-mixed"], ["unknown", "recompute full", "32-true"]]
    assert filled["lr"].tolist() == [1.0, 2.0] and trials["method"].isna().any()  # a copy
    assert variant_label("galore", "none", "32-true") == "galore"
    assert variant_label("galore", "offload mlp", "32-true") == "galore (offload mlp)"
    label = variant_label("galore", "offload mlp", "bf16-mixed")
    assert label == "galore (offload mlp, bf16-mixed)"
    assert variant_label("full", "none", "16-mixed") == "full (16-mixed)"
