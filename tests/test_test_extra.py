"""What `pip install -e ".[test]"` brings: every requirement of the test extra says which
versions, so a fresh install (CI's) gets what the tests were written against. (An unpinned
83 MB model package was one; the encoder test now builds its model: test_finetune.py.)"""

from __future__ import annotations

import tomllib
from conftest import REPO
from packaging.requirements import Requirement


def extra_requirements() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["test"]]


def test_every_test_requirement_names_its_versions() -> None:
    requirements = extra_requirements()
    assert len(requirements) > 5  # the extra was read
    assert [str(r) for r in requirements if not r.specifier] == []
