"""The bugs tests/config/test_fuzz.py found, each pinned as its own case: every one used to be a
traceback (or a message over two lines, or naming the wrong key) and is now one line naming
the key and what is allowed."""

from __future__ import annotations

import pytest
from conftest import write_yaml

from harness.config import parse_overrides, read_yaml, set_dotted, validate
from harness.config.launchers.slurm import SlurmConfig
from harness.errors import UserError, render
from harness.methods.resolve import load_run
from harness.sweep.plan.expand import expand, load_sweep

SWEEP = {"name": "s", "model": "llama_micro", "methods": {"full": {}}}


def fails(match: str, load, *args) -> None:
    with pytest.raises(UserError, match=match) as caught:
        load(*args)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("raw", "match"), [
    (b"name: s\nmethods: {full: {}}\xff\n", r"sweep.yaml: not UTF-8 text \(byte 0xff at offset "
                                           r"27\); save it as UTF-8$"),  # UnicodeDecodeError
    (b"name: s\n\x00", r"sweep.yaml: not valid YAML \(special characters are not allowed\)$"),
    (b"name: s\ntrain: {2024-01-02: 1}\n", r"sweep.yaml: key 2024-01-02 in train is not a name "
                                          r"\(YAML reads it as date\)"),  # TypeError in json
    (b"name: s\nsearch: {enqueue: [{true: 1}]}\n", r"key True in search.enqueue.0 is not a name"),
])  # fmt: skip
def test_a_file_that_is_not_a_config_is_one_line(tmp_path, raw, match):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(raw)
    fails(match, read_yaml, path)


@pytest.mark.parametrize(("change", "match"), [
    ({"search": "abc"}, r"^search: 'abc' is invalid"),  # AttributeError under --set
    ({"methods": "abc"}, r"^methods: 'abc' is invalid"),
    ({"methods": {"x": {"method": [1, 2]}}},
     r"^methods.x.method: \[1, 2\] is not a method name"),  # said "missing key methods.x.name"
    ({"methods": {"full": {"space": {1: [2]}}}},
     r"^methods.full.space: 1 is not a dotted key of the run config"),  # AttributeError
    ({"launcher": {"profile": True}}, r"^launcher.profile: True is invalid"),  # TypeError
    ({"launcher": {"kind": "slurm", "mem": "64 GB"}},
     r"^launcher.mem: '64 GB' is not a Slurm memory size"),
    ({"train": {"precision": [1, 2]}}, r"^train.precision: \[1, 2\] is not allowed"),
])  # fmt: skip
def test_a_malformed_section_under_set_is_one_line(tmp_path, change, match):
    """Given as a `--set`, after the file is read, as the CLI applies it (space keys set this
    way skip read_yaml's key check and reach the grid)."""
    path = write_yaml(tmp_path / "sweep.yaml", SWEEP)
    fails(match, lambda: expand(load_sweep(path, change)))


def test_a_run_takes_a_list_precision_in_one_line():
    fails(r"^train.precision: \[1, 2\] is not allowed", load_run, {},
          parse_overrides(["train.precision=[1, 2]"]))  # TypeError: unhashable list


@pytest.mark.parametrize("key", ["train..lr", ".lr", "train."])
def test_a_dotted_key_with_an_empty_part_is_refused(key):
    fails(rf"^{key}: a dotted key with an empty part \(expected e.g. train.lr\)$", set_dotted,
          {}, key, 1)


def test_slurm_memory_sizes_are_sbatch_ones():
    """As this project's Slurm (slurm/cluster.sh) answers `sbatch --test-only --mem=...`."""
    for good in ("64G", "64GB", "500m", "1kb", "0", "200"):
        assert validate(SlurmConfig, {"mem": good}).mem == good
    for bad in ("1.5G", "64 G", "1MiB", "lots", "-1G"):
        fails(r"^mem: .* is not a Slurm memory size \(allowed: a whole number with an optional "
              r"unit K, M, G or T", validate, SlurmConfig, {"mem": bad})


def test_a_user_error_is_one_line_whatever_the_user_wrote():
    """Keys and values quoted from a file may hold newlines or other control characters; they
    are escaped once, in UserError, so that no raiser has to remember."""
    error = UserError("unknown key 'a\nb\u2028c\td' (allowed: é)")
    assert str(error) == "unknown key 'a\\nb\\u2028c\\td' (allowed: é)"
    assert render(error).count("\n") == 0
