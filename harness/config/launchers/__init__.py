"""Each launcher's config, a class of its own, and the union of them keyed on `kind`.

They live here, not beside the launchers in harness/sweep/launchers/, because harness.config
sits below harness.sweep: a sweep file is read and checked without importing what runs its
trials. A launcher's config is a `LauncherConfig` subclass in a file here whose `kind` is a
Literal of the kinds it runs; adding one is that file and its class in `CONFIGS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Discriminator, RootModel, Tag

from harness.config.launchers.base import LauncherConfig
from harness.config.launchers.local import LocalConfig
from harness.config.launchers.ray import RayConfig
from harness.config.launchers.slurm import SlurmConfig, read_profile

CONFIGS: tuple[type[LauncherConfig], ...] = (LocalConfig, SlurmConfig, RayConfig)
KINDS: dict[str, type[LauncherConfig]] = {k: c for c in CONFIGS for k in c.kinds()}


def kind(value: Any) -> str:
    """The `kind` a launcher block names (named as the key: errors name it); without one, or
    not a mapping (its class then says so), local."""
    if isinstance(value, dict):
        kind = value.get("kind", "local")
        return kind if isinstance(kind, str) else repr(kind)
    return getattr(value, "kind", "local")


AnyLauncher = Annotated[
    Union[tuple(Annotated[c, Tag(k)] for k, c in KINDS.items())],  # noqa: UP007 (built)
    Discriminator(kind),
]


class Launcher(RootModel[AnyLauncher]):
    """Any launcher's keys on their own (a cluster profile's file)."""


def process_kinds() -> list[str]:
    """The kinds that run a trial of several processes."""
    return [k for k, c in KINDS.items() if c.processes]


def standalone_kinds() -> list[str]:
    """The kinds that run on this machine with nothing to start first."""
    return [k for k, c in KINDS.items() if k in c.standalone()]


def with_profile(launcher: Any, sweep_path: Path) -> Any:
    """A launcher block that names a `profile`: the profile's keys, the block's own winning."""
    profile = launcher.get("profile") if isinstance(launcher, dict) else None
    if not profile or not isinstance(profile, str):  # any other value: validate's one line
        return launcher
    return {**read_profile(profile, sweep_path, Launcher), **launcher}


__all__ = ["CONFIGS", "KINDS", "AnyLauncher", "Launcher", "LauncherConfig", "LocalConfig",
           "process_kinds", "standalone_kinds", "with_profile"]
