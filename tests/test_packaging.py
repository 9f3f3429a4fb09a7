"""A non-editable install (the GPU kit's wheel, scripts/check_layers.sh) holds every package."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"harness": "harness", "methods": "harness.methods", "analysis": "harness.analysis"}


def test_every_package_folder_is_listed_for_setuptools() -> None:
    """pyproject lists packages by hand (methods/ and analysis/ install under harness), so a new
    folder left out of the list would be missing from every installed copy but an editable one."""
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("packages = [", 1)[1].split("]")[0]
    listed = set(re.findall(r'"(harness(?:\.\w+)*)"', block))
    folders = set()
    for top, name in ROOTS.items():
        for init in (REPO / top).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / top).parts
            folders.add(".".join((name, *parts)))
    assert folders - listed == set(), f"packages missing from pyproject: {sorted(folders - listed)}"
