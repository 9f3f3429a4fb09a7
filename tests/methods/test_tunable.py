"""The settings each method's config marks tunable (harness/config/tuning.py `tunable`): at
most two a method, each default on its ladder, shown by `harness methods`."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.config.tuning import tunable, tunables
from harness.methods import get_method, method_names


def test_every_method_marks_at_most_two_settings_its_default_among_their_values():
    marked = {name: tunables(get_method(name).Config) for name in method_names()}
    assert all(len(fields) <= 2 for fields in marked.values()), marked
    for name, fields in marked.items():
        config = get_method(name).Config
        for field, values in fields.items():
            assert config.model_fields[field].get_default() in values, (name, field)
    assert marked["galore"] == {"update_proj_gap": [50, 100, 200, 500],
                                "scale": [0.125, 0.25, 0.5, 1.0]}
    assert marked["muon"] == {"momentum": [0.9, 0.95, 0.98]}


def test_a_tunable_default_off_its_ladder_is_a_programming_error():
    with pytest.raises(ValueError, match="not among its values"):
        tunable(0.3, values=[0.1, 0.2], source="x", description="y")


def test_harness_methods_shows_each_tunable_ladder(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    galore = out[out.index("galore:"):out.index("apollo:")]
    assert "update_proj_gap: int = 200  - steps between SVDs (T); tuned over [50, 100, 200, " \
           "500]" in galore

