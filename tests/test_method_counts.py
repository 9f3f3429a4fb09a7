"""The method counts README.md, docs/ and the shipped sweeps state agree with the sweep files
they describe, and none states the registry's size (a method added changes no page)."""

from __future__ import annotations

import re

import yaml
from conftest import REPO

WORDS = {"eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
         "fourteen": 14, "fifteen": 15}
# benchmarks.md is a log: each entry states the registry as it was when it was measured
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md")
                                    if p.name != "benchmarks.md"),
        *sorted((REPO / "sweeps").glob("*.yaml"))]


def number(text: str) -> int:
    return int(text) if text.isdigit() else WORDS[text.lower()]


def entries(sweep: str) -> dict:
    return yaml.safe_load((REPO / "sweeps" / f"{sweep}.yaml").read_text())["methods"]


def test_no_page_states_how_many_methods_are_registered() -> None:
    """A method added is its file, its companion and its test: no page or sweep file states
    the registry's size, which would go stale (`harness methods` lists them)."""
    counts = [(path.name, n) for path in DOCS
              for n in re.findall(r"\b(\w+)\s+registered\s+methods\b", path.read_text())
              if n.isdigit() or n.lower() in WORDS]
    assert counts == []


def test_the_quickstart_and_repro_small_counts_are_their_files() -> None:
    """The README, docs/sweeps.md and the quickstart's comment say "nine entries (8 of the ...
    methods)"; the README and repro_small's comment say how many methods repro_small runs."""
    quick = entries("quickstart")
    methods = {(v or {}).get("method", k) for k, v in quick.items()}
    stated = [(path.name, number(n), m and number(m)) for path in
              (REPO / "README.md", REPO / "docs" / "sweeps.md", REPO / "sweeps" / "quickstart.yaml")
              for n, m in re.findall(r"\b(\w+) entries \((?:(\w+) of the)?", path.read_text())]
    assert len(stated) == 3
    assert all(n == len(quick) and m in ("", len(methods)) for _, n, m in stated), stated
    small = len(entries("repro_small"))
    readme = (REPO / "README.md").read_text()
    comment = (REPO / "sweeps" / "repro_small.yaml").read_text().splitlines()[0]
    said = re.findall(r"repro_small\.yaml` runs (\w+) methods", readme)
    said += re.findall(r": (\w+) methods", comment)
    assert [number(n) for n in said] == [small, small]
