"""A trial's summary.json as one typed model: what the trainer writes, what the launchers
mark, what `status`, the sweep and the report tables read.

Its fields, in the order of the report's columns, are the one list of summary fields: the
analysis takes its columns from `Summary.columns()`. They are the trial's identity, then each
metric of the registry (harness/config/metrics.py) in its order, then where and how it ran.
The trainer adds measured fields the model does not name (build_s, best_eval_*, loss_scale,
...): they are kept as extra fields.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model

from harness.config import RunConfig
from harness.config.metrics import REGISTRY
from harness.trials.status import Status

Number = int | float | None
_KEPT = {"column": False}  # written to summary.json, not a column of the tables
_NUMERIC = {"numeric": True}  # a column the tables read as numbers


def _num() -> Any:
    return Field(None, json_schema_extra=_NUMERIC)


class _Trial(BaseModel):
    """Which trial: the summary's first fields."""

    model_config = ConfigDict(extra="allow", use_enum_values=True)

    trial: str | None = None
    status: Status = Status.PENDING
    method: str | None = None  # the method's label in its sweep
    method_name: str | None = None
    params: dict[str, Any] | None = Field(None, json_schema_extra=_KEPT)
    lr: Number = _num()
    seed: int | None = None
    model: str | None = None
    steps: Number = _num()
    step: Number = _num()
    tokens: Number = _num()


# The registry's metrics that every summary has, as numeric fields in the registry's order.
_Measured: type[_Trial] = create_model(
    "_Measured", __base__=_Trial, **{m.name: (Number, _num()) for m in REGISTRY if m.field})


class Summary(_Measured):  # type: ignore[misc,valid-type]
    """One trial's summary. Read from disk it keeps the file's keys in their order, so a
    launcher that marks it failed or counts a requeue rewrites it with only that changed."""

    processes: Number = _num()  # data-parallel processes (GPUs) the trial used
    load_average: Number = _num()  # the host's 1-minute load average while tok/s was measured
    cpu_count: Number = _num()
    measured_from: float | None = Field(None, json_schema_extra=_KEPT)  # tok/s's wall-clock span
    measured_to: float | None = Field(None, json_schema_extra=_KEPT)
    device: str | None = None
    error: str | None = None
    host: str | None = Field(None, json_schema_extra=_KEPT)
    started_at: float | None = Field(None, json_schema_extra=_KEPT)
    pid: int | None = Field(None, json_schema_extra=_KEPT)  # while running, for trial_status
    warnings: list[str] | None = Field(None, json_schema_extra=_KEPT)  # load-time, one line each
    # Filled by the analysis from config.yaml, not by the trainer.
    memory: str | None = None
    precision: str | None = None

    _order: tuple[str, ...] = PrivateAttr(default=())

    @classmethod
    def start(cls, run: RunConfig, trial: str, requeues: int = 0) -> Summary:
        """The summary as a trial starts, its keys in this order: which trial, the metrics
        the registry marks `at_start` (null until the end), where it runs."""
        model = run.model if isinstance(run.model, str) else str(run.model)
        return cls.parse({
            "trial": trial, "status": Status.RUNNING, "method": run.label or run.method_name,
            "method_name": run.method_name, "params": run.method_params, "lr": run.train.lr,
            "seed": run.seed, "model": model, "steps": run.train.steps, "step": 0, "tokens": 0,
            **{m.name: None for m in REGISTRY if m.at_start},
            "device": None, "error": None, "requeues": requeues,
            "host": socket.gethostname(), "started_at": time.time(),
        })  # fmt: skip

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Summary:
        """Validated where the file's values have the field's type; a file with odd values (a
        status this version does not know) is still read, as it is, not refused."""
        try:
            summary = cls.model_validate(data)
        except ValidationError:
            summary = cls.model_construct(**data)
        summary._order = tuple(data)
        return summary

    def to_dict(self) -> dict[str, Any]:
        """The keys the trial has, in the file's order (new keys after), as summary.json."""
        data = self.model_dump(exclude_unset=True, warnings=False)
        first = {k: data[k] for k in self._order if k in data}
        return {**first, **data}

    def update(self, **changes: Any) -> Summary:
        """A copy with `changes` set (fields or extra keys), the key order kept."""
        changed = self.model_copy(update=changes)
        changed._order = self._order
        return changed

    def get(self, key: str, default: Any = None) -> Any:
        """A key's value as the file has it (`default` where absent), fields and extras alike:
        a sweep's metric may be any measured key."""
        if key in type(self).model_fields:
            return getattr(self, key) if key in self.model_fields_set else default
        return (self.model_extra or {}).get(key, default)

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        """The fields the report tables show, in their order."""
        return tuple(k for k, f in cls.model_fields.items() if _marks(f).get("column", True))

    @classmethod
    def numeric_columns(cls) -> tuple[str, ...]:
        return tuple(k for k, f in cls.model_fields.items() if _marks(f).get("numeric"))


def _marks(field: Any) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}
