"""The sweep's one call into its launcher; every launcher is imported here, which registers
it under its kinds (harness/sweep/launchers/__init__.py says how to add one)."""

from __future__ import annotations

from pathlib import Path

from harness.config import LauncherConfig
from harness.sweep.launchers import local, ray, slurm  # noqa: F401  (each registers itself)
from harness.sweep.launchers.base import LAUNCHERS
from harness.sweep.run.stop import deferred
from harness.sweep.search.source import Source


def check_launcher(launcher: LauncherConfig) -> None:
    """One line, before anything is read or written, when `launcher.kind` cannot run here."""
    LAUNCHERS[launcher.kind].check(launcher)


def launch(sources: list[Source], launcher: LauncherConfig, out: Path,
           total: int | None = None) -> None:
    """Work every source on the launcher of `launcher.kind`; `total`, a grid's trial count,
    draws a progress bar of trials."""
    if not sources:
        return
    with deferred():  # a stop signal is acted on where the launcher polls for it
        LAUNCHERS[launcher.kind](launcher, out).launch(sources, total)
