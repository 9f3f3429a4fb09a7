"""A trial's summary.json as one typed model: what the trainer writes, what the launchers
mark, what `status`, the sweep and the report tables read.

Its fields, in the order of the report's columns, are the one list of summary fields: the
analysis takes its columns from `Summary.columns()`. The trainer adds measured fields the
model does not name (build_s, best_eval_*, loss_scale, ...): they are kept as extra fields.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from harness.config import RunConfig
from harness.trials.status import Status

Number = int | float | None
_KEPT = {"column": False}  # written to summary.json, not a column of the tables
_NUMERIC = {"numeric": True}  # a column the tables read as numbers


def _num() -> Any:
    return Field(None, json_schema_extra=_NUMERIC)


class Summary(BaseModel):
    """One trial's summary. Read from disk it keeps the file's keys in their order, so a
    launcher that marks it failed or counts a requeue rewrites it with only that changed."""

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
    eval_loss: Number = _num()
    eval_ppl: Number = _num()
    tokens_per_s: Number = _num()
    mfu: Number = _num()
    peak_memory_bytes: Number = _num()  # live tensors: CUDA max allocated, CPU a steady step's
    peak_rss_bytes: Number = _num()  # the trial process's peak resident set, allocator slack too
    param_bytes: Number = _num()
    grad_bytes: Number = _num()
    optimizer_state_bytes: Number = _num()
    trainable_params: Number = _num()
    total_params: Number = _num()
    wall_s: Number = _num()
    processes: Number = _num()  # data-parallel processes (GPUs) the trial used
    load_average: Number = _num()  # the host's 1-minute load average while tok/s was measured
    cpu_count: Number = _num()
    measured_from: float | None = Field(None, json_schema_extra=_KEPT)  # tok/s's wall-clock span
    measured_to: float | None = Field(None, json_schema_extra=_KEPT)
    device: str | None = None
    error: str | None = None
    requeues: Number = _num()
    final_model_bytes: Number = _num()  # the final model's files (train.keep_final), once written
    host: str | None = Field(None, json_schema_extra=_KEPT)
    started_at: float | None = Field(None, json_schema_extra=_KEPT)
    pid: int | None = Field(None, json_schema_extra=_KEPT)  # while running, for trial_status
    warnings: list[str] | None = Field(None, json_schema_extra=_KEPT)  # load-time, one line each
    # Filled by the analysis from metrics.jsonl and config.yaml, not by the trainer.
    last_loss: Number = _num()
    memory: str | None = None
    precision: str | None = None
    extra_bytes: Number = _num()
    skipped_steps: Number = _num()
    offloaded_bytes_per_step: Number = _num()

    _order: tuple[str, ...] = PrivateAttr(default=())

    @classmethod
    def start(cls, run: RunConfig, trial: str, requeues: int = 0) -> Summary:
        """The summary as a trial starts: every field the tables read, filled in at the end."""
        model = run.model if isinstance(run.model, str) else str(run.model)
        return cls(
            trial=trial, status=Status.RUNNING, method=run.label or run.method_name,
            method_name=run.method_name, params=run.method_params, lr=run.train.lr,
            seed=run.seed, model=model, steps=run.train.steps, step=0, tokens=0,
            eval_loss=None, eval_ppl=None, tokens_per_s=None, mfu=None, peak_memory_bytes=None,
            peak_rss_bytes=None, param_bytes=None, grad_bytes=None, optimizer_state_bytes=None,
            trainable_params=None, wall_s=None, device=None, error=None, requeues=requeues,
            host=socket.gethostname(), started_at=time.time(),
        )  # fmt: skip

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
