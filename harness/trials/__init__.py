"""The run folder: one trial's config, metrics, summary and checkpoint."""

from harness.trials.records import (
    Records,
    atomic_write,
    base_summary,
    read_json,
    read_jsonl,
    rng_state,
    set_rng_state,
    write_json,
    write_yaml,
)

__all__ = ["Records", "atomic_write", "base_summary", "read_json", "read_jsonl", "rng_state",
           "set_rng_state", "write_json", "write_yaml"]
