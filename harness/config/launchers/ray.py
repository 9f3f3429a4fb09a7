"""The Ray launcher's config: each trial on a Ray cluster, its processes holding the CPUs and
GPUs named here (harness/sweep/launchers/ray.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from harness.config.launchers.base import LauncherConfig


class RayConfig(LauncherConfig):
    kind: Literal["ray"] = "ray"
    address: str | None = Field(
        None, description="the cluster's address (host:port of `ray start --head`); default: "
        "RAY_ADDRESS, else the cluster this machine runs")
    cpus_per_task: int = Field(1, ge=1, description="Ray CPUs per trial process (its threads)")
    gpus_per_task: int = Field(0, ge=0, description="Ray GPUs per trial process")

    processes: ClassVar[bool] = True

    @model_validator(mode="after")
    def _one_gpu_a_process(self) -> RayConfig:
        if self.ranks > 1 and self.gpus_per_task > 1:
            raise ValueError(f"gpus_per_task {self.gpus_per_task} with nodes x tasks_per_node "
                             f"{self.ranks}: a trial of several processes takes one GPU per "
                             "process (cuda:LOCAL_RANK); allowed: 0 or 1")
        return self

    @property
    def runs_here(self) -> bool:
        return False  # on the cluster's nodes, whose devices the sweep's machine cannot see
