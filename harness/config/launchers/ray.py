"""The Ray launcher's config: each trial on a Ray cluster, its processes holding the CPUs and
GPUs named here (harness/sweep/launchers/ray.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from harness.config.launchers.base import LauncherConfig


class RayConfig(LauncherConfig):
    kind: Literal["ray"] = "ray"
    address: str | None = Field(
        None, description="the cluster's address (host:port of `ray start --head`); default: "
        "RAY_ADDRESS, else the cluster this machine runs")
    cpus_per_task: int = Field(1, ge=1, description="Ray CPUs per trial process (its threads)")
    gpus_per_task: int = Field(0, ge=0, description="Ray GPUs per trial process")

    processes: ClassVar[bool] = True

    @property
    def runs_here(self) -> bool:
        return False  # on the cluster's nodes, whose devices the sweep's machine cannot see
