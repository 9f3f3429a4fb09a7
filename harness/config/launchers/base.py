"""What every launcher's config has: its `kind`, how many trials run at once, the shape of a
trial's processes and how often an interrupted trial is resubmitted."""

from __future__ import annotations

from typing import ClassVar, get_args

from pydantic import Field

from harness.config.strict import Strict


class LauncherConfig(Strict):
    """The keys every launcher reads; a launcher's own class adds its keys and narrows `kind`
    to the kinds it runs."""

    kind: str = "local"
    jobs: int = Field(1, ge=1, description="trials run at once (Optuna: workers)")
    profile: str | None = Field(None, description="a named set of launcher keys (a cluster "
                                "profile): docs/launchers.md")
    nodes: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1, description="processes per node (DDP ranks)")
    max_requeues: int = Field(
        3, ge=0, description="times the sweep resubmits a trial left interrupted with a checkpoint"
    )

    processes: ClassVar[bool] = False  # can run a trial of several processes (DDP, FSDP)

    @classmethod
    def kinds(cls) -> tuple[str, ...]:
        """The `kind` values this class takes (its `kind` field's Literal)."""
        return get_args(cls.model_fields["kind"].annotation) or (cls.model_fields["kind"].default,)

    @classmethod
    def standalone(cls) -> tuple[str, ...]:
        """Its kinds that run on this machine with nothing to start first (`harness bench
        launch` times each)."""
        return ()

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def at_once(self) -> int:
        """Trials that run together."""
        return self.jobs

    @property
    def runs_here(self) -> bool:
        """Its trials run on this machine (so this machine's device must fit them)."""
        return True
