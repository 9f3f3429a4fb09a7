"""The run folder: a sweep's folder and its trials' folders, their files, each trial's
summary and status. Nothing outside this package spells a file name of the run folder."""

from typing import Any

from harness.trials.files import (
    atomic_file,
    atomic_write,
    read_json,
    read_jsonl,
    read_jsonl_tail,
    write_json,
    write_yaml,
)
from harness.trials.folder import RunsDir, TrialDir
from harness.trials.status import FAILED, FINISHED, Status
from harness.trials.summary import Summary

__all__ = ["FAILED", "FINISHED", "CheckpointError", "Records", "RunsDir", "Status", "Summary",
           "TrialDir", "atomic_file", "atomic_write", "read_json", "read_jsonl",
           "read_jsonl_tail", "rng_state", "set_rng_state", "write_json", "write_yaml"]

# Names whose modules import torch, loaded on first use: the commands that only read run
# folders (status, report) start without torch.
LAZY = {"CheckpointError": "checksums", "Records": "records", "rng_state": "records",
        "set_rng_state": "records"}


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{LAZY[name]}"), name)
