"""The Slurm launcher's config (submitit: on a Slurm cluster, or its local executor), and the
cluster profiles its keys may come from, `slurm/<name>.yaml`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from harness.config.launchers.base import LauncherConfig
from harness.config.load import read_yaml, validate
from harness.errors import suggest


class SlurmConfig(LauncherConfig):
    """`submitit-local` runs the same jobs on this machine: a cluster setup tried without one."""

    kind: Literal["submitit-local", "slurm"] = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    mem: str | None = Field(None, description="memory per node, e.g. 64G")
    timeout_min: int = Field(60, ge=1, description="time limit per job; it requeues after it")
    signal_delay_s: int = Field(90, ge=1, description="USR2 this long before the time limit")
    max_timeouts: int = Field(3, ge=0, description="requeues after a time limit (preemption: any)")
    array_parallelism: int | None = Field(None, ge=1, description="default: jobs")
    sbatch: dict[str, str | int | bool] = Field(
        default_factory=dict, description="extra #SBATCH options, e.g. {exclusive: true}"
    )
    setup: list[str] = Field(
        default_factory=list, description="shell lines run first (module load, conda activate)"
    )

    processes: ClassVar[bool] = True

    @classmethod
    def standalone(cls) -> tuple[str, ...]:
        return ("submitit-local",)

    @field_validator("mem")
    @classmethod
    def _slurm_size(cls, value: str | None) -> str | None:
        """sbatch --mem's own format (as sbatch checks it), here rather than by a job that never
        starts."""
        if value is not None and not re.fullmatch(r"\d+(?:[KMGT]B?)?", value, re.IGNORECASE):
            raise ValueError(f"{value!r} is not a Slurm memory size (allowed: a whole number "
                             "with an optional unit K, M, G or T, e.g. 64G or 64GB; 0: all of a "
                             "node's)")
        return value

    @property
    def at_once(self) -> int:
        """A Slurm array's parallelism (default jobs)."""
        return self.array_parallelism or self.jobs

    @property
    def runs_here(self) -> bool:
        return self.kind == "submitit-local"


def read_profile(name: str, sweep_path: Path, check: type[BaseModel]) -> dict[str, Any]:
    """A named cluster profile, `slurm/<name>.yaml` beside the working or the sweep's folder,
    checked as `check` (any launcher's config, of the kind it names)."""
    places = [Path("slurm"), sweep_path.resolve().parent.parent / "slurm"]
    found = [p / f"{name}.yaml" for p in places if (p / f"{name}.yaml").is_file()]
    if not found:
        known = sorted({f.stem for p in places if p.is_dir() for f in p.glob("*.yaml")})
        raise suggest(name, known, "cluster profile", "launcher.profile")
    data = read_yaml(found[0])
    validate(check, data, prefix=f"{found[0]}: ")
    return data
