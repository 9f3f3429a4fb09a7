"""The local launcher's config: trials as child processes of the sweep, `jobs` at a time."""

from __future__ import annotations

from typing import Literal

from harness.config.launchers.base import LauncherConfig


class LocalConfig(LauncherConfig):
    kind: Literal["local"] = "local"

    @classmethod
    def standalone(cls) -> tuple[str, ...]:
        return ("local",)
