"""harness/config/space.py: grid lists and Optuna distributions as a sweep file writes them."""

from __future__ import annotations

import pytest

from harness.config.space import check_distributions, check_space, distribution
from harness.errors import UserError


def test_grid_space_is_a_mapping_of_non_empty_lists():
    space = {"train.lr": [1e-3, 3e-3], "memory.recompute": ["none", ["mlp"]]}
    assert check_space(space, "search.space") is space
    for bad in ([("train.lr", [1])], None):
        with pytest.raises(UserError, match=r"^search.space: expected a mapping of dotted keys "
                                            r"to non-empty lists, got "):
            check_space(bad, "search.space")
    for bad in ({"train.lr": []}, {"train.lr": 0.001}):  # the message names the key
        with pytest.raises(UserError, match=r"^search.space.train.lr: expected a non-empty list "
                                            r"of values, got "):
            check_space(bad, "search.space")


@pytest.mark.parametrize("key", [1, None, "train..lr", ".lr", ""])
def test_a_space_key_is_a_dotted_string(key):
    """It is set into each trial's config; an int key (`1: [2]` in YAML) used to crash there."""
    for check, values in ((check_space, [1]), (check_distributions, [1])):
        with pytest.raises(UserError, match=rf"^search.space: {key!r} is not a dotted key"):
            check({key: values}, "search.space")


def test_a_list_is_categorical():
    assert distribution(["a", 1, None], "p") == {"choices": ["a", 1, None]}
    with pytest.raises(UserError, match=r"^p: an empty list \(a categorical needs at least one"):
        distribution([], "p")


def test_float_int_and_log_ranges():
    assert distribution({"low": 1e-4, "high": 1e-2, "log": True}, "p") == {
        "low": 1e-4, "high": 1e-2, "log": True, "step": None, "int": False}
    assert distribution({"low": 1, "high": 9, "step": 2}, "p") == {
        "low": 1, "high": 9, "log": False, "step": 2, "int": True}
    assert distribution({"low": 0, "high": 100}, "p")["int"] is True
    assert distribution({"low": 0, "high": 1.0}, "p")["int"] is False
    assert distribution({"low": 0, "high": 10, "step": 0.5}, "p")["int"] is False


def test_yaml_strings_that_look_like_numbers_are_numbers():
    """YAML 1.1 reads 1e-4 (no dot) as a string."""
    d = distribution({"low": "1e-4", "high": "1e-2", "log": True}, "p")
    assert (d["low"], d["high"], d["int"]) == (1e-4, 1e-2, False)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0.1, r"p: 0.1 is not a distribution \(allowed: a list of choices, or \{low, high\}"),
        ({"low": 1}, r"p: \{'low': 1\} is not a distribution"),
        ({"low": 1, "high": 2, "base": 10}, r"p: unknown key 'base' \(allowed: low, high, log, "),
        ({"low": "a", "high": 2}, r"p: low, high and step must be numbers"),
        ({"low": True, "high": 2}, r"p: low, high and step must be numbers"),
        ({"low": 0, "high": 1, "step": "x"}, r"p: low, high and step must be numbers"),
        ({"low": 0, "high": 1, "log": "yes"}, r"p.log: 'yes' is not allowed \(allowed: true, "),
        ({"low": 2, "high": 2}, r"p: low 2 must be below high 2"),
        ({"low": 0, "high": 1, "log": True}, r"p: log: true needs low > 0 and no step"),
        ({"low": 1, "high": 8, "log": True, "step": 1}, r"p: log: true needs low > 0 and no st"),
        ({"low": 0, "high": 1, "step": -0.1}, r"p.step: -0.1 must be positive"),
    ],
)
def test_bad_distributions_name_the_key(value, message):
    with pytest.raises(UserError, match=f"^{message}"):
        distribution(value, "p")


def test_check_distributions_prefixes_each_key():
    space = {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}, "seed": [0, 1]}
    checked = check_distributions(space, "search.space")
    assert checked["seed"] == {"choices": [0, 1]} and checked["train.lr"]["log"] is True
    with pytest.raises(UserError, match=r"^search.space.train.lr: low 1 must be below high 0.1"):
        check_distributions({"train.lr": {"low": 1, "high": 0.1}}, "search.space")
    with pytest.raises(UserError, match=r"^search.space: expected a mapping of dotted keys to "
                                        r"distributions, got \['train.lr'\]"):
        check_distributions(["train.lr"], "search.space")
