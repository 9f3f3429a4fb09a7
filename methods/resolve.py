"""A run config resolved against the registry: the method's typed settings with their
defaults, and the modifiers it refuses (config cannot know the methods: they sit above it)."""

from __future__ import annotations

import json
from typing import Any

from harness.config import RunConfig, Strict, set_dotted, validate
from harness.errors import UserError
from harness.methods.base import build_method, get_method
from harness.models import check_model

# One setting per modifier, as `harness methods` tries each on a method's defaults.
MODIFIER_TRIALS: dict[str, dict[str, Any]] = {
    "recompute": {"memory": {"recompute": "full"}},
    "offload": {"memory": {"offload": ["mlp"]}},
    "layerwise": {"memory": {"layerwise": True}},
    "optimizer_offload host": {"memory": {"optimizer_offload": "host"}},
    "optimizer_offload paged": {"memory": {"optimizer_offload": "paged"}},
    "16-mixed": {"train": {"precision": "16-mixed"}},
    "bf16-true": {"train": {"precision": "bf16-true"}},
    "bf16-true kahan": {"train": {"precision": "bf16-true", "update_compensation": "kahan"}},
    "fsdp": {"train": {"parallel": "fsdp"}},
}


def resolve_method(spec: dict[str, Any], path: str) -> tuple[str, Strict]:
    """Check a method spec against the registry: its name and typed settings (with defaults).
    The one place a method's settings are validated; `build_method` reuses them."""
    spec = dict(spec)
    name = spec.pop("name", None)
    if not isinstance(name, str):
        raise UserError(f"missing key '{path}.name' (a method name; see `harness methods`)")
    return name, validate(get_method(name, f"{path}.name").Config, spec, prefix=f"{path}.")


def load_run(data: dict[str, Any], overrides: dict[str, Any] | None = None) -> RunConfig:
    data = json.loads(json.dumps(data, default=str))
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    run = validate(RunConfig, data)
    run.set_method(*resolve_method(run.method, "method"))
    check_model(run)
    check_modifiers(run)
    return run


def check_modifiers(run: RunConfig) -> None:
    """Refuse, with the method's reason, memory modifiers or a precision it cannot honour."""
    if run.train.precision == "bf16-true" and run.memory.optimizer_offload == "paged":
        raise UserError("memory.optimizer_offload paged with train.precision bf16-true: "
                        "bitsandbytes' paged optimizers neither honour train.state_dtype nor "
                        "compensate updates; use optimizer_offload: host")
    terms = build_method(run).check(run)
    if terms.refusal:
        raise UserError(f"method {run.method_name}: {terms.refusal}")
    if terms.in_backward and run.train.compile:
        raise UserError(f"method {run.method_name} with train.compile: its INT8 layers update "
                        "inside backward, which a compiled graph cannot trace; use "
                        "train.compile: false")
    if run.train.sharded:
        check_fsdp(run, terms.fsdp)


def check_fsdp(run: RunConfig, reason: str | None) -> None:
    """Refuse what `train.parallel: fsdp` (or hsdp, which shards the same way within each
    group) cannot shard, in one line with what to use instead."""
    with_parallel = f"with train.parallel {run.train.parallel}"
    if reason:
        raise UserError(f"method {run.method_name} {with_parallel}: {reason}")
    if run.train.precision == "16-mixed":
        raise UserError(f"train.precision 16-mixed {with_parallel}: GradScaler checks "
                        "each rank's gradient shard for overflow on its own, so ranks could "
                        "disagree on skipping a step; use bf16-mixed")
    if run.memory.optimizer_offload == "paged":
        raise UserError(f"memory.optimizer_offload paged {with_parallel}: bitsandbytes' "
                        "paged optimizers take whole tensors, not FSDP's shards; use "
                        "optimizer_offload: host (FSDP's own CPU offload)")


def modifier_support(method: str) -> dict[str, str | None]:
    """Each modifier -> None if `method` accepts it with its default settings, else why not."""
    support: dict[str, str | None] = {}
    for modifier, data in MODIFIER_TRIALS.items():
        try:
            load_run({**data, "method": {"name": method}})
            support[modifier] = None
        except UserError as e:
            support[modifier] = str(e).removeprefix(f"method {method}: ").removeprefix(
                f"method {method} with train.parallel fsdp: ")
    return support
