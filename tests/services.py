"""The services and privileges some tests need (Slurm, PostgreSQL, Chromium, root for a
tmpfs): skipped with how to get them on a developer's machine, a failure in CI (CI=true, which
.ci/run sets), where they must be there. Imported as `from services import ...`; conftest.py
imports the `small_disk` fixture."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def missing(what: str, how: str) -> None:
    """A test that needs a service or a privilege this machine lacks: skipped with `how` to get
    it on a developer's machine, a failure in CI (CI=true, which .ci/run sets), where it must
    be there."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI ({how})")
    pytest.skip(f"needs {what}: {how}")


def chromium() -> str:
    """Skipped on a developer's machine without it, but never in CI, where .ci/run installs it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        missing("chromium", "`sudo bash scripts/chromium.sh`")
    return path  # type: ignore[return-value]


def headless(browser: str, page: Path, profile: Path, *flags: str) -> str:
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", f"--user-data-dir={profile}", *flags, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout


def require_service(env: str, what: str, start: str) -> str:
    """Tests on a real cluster or database: the service's address from `env`, which `.ci/run`
    sets after starting it."""
    value = os.environ.get(env)
    if not value:
        missing(what, f"`{start}`, then set {env}")
    return value  # type: ignore[return-value]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 64 MiB tmpfs. Mounting one needs root: skipped on a developer's machine without
    it, never in CI (.ci/run runs as root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True,
        text=True) if os.geteuid() == 0 else None
    if mounted is None or mounted.returncode:
        missing("a tmpfs mount", mounted.stderr.strip() if mounted else "run as root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)
