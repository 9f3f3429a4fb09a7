"""The run folder: a sweep's folder and its trials' folders, their files, each trial's
summary and status. Nothing outside this package spells a file name of the run folder."""

from harness.trials.checkpoints import CheckpointError
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
from harness.trials.records import Records, rng_state, set_rng_state
from harness.trials.status import FAILED, FINISHED, Status
from harness.trials.summary import Summary

__all__ = ["FAILED", "FINISHED", "CheckpointError", "Records", "RunsDir", "Status", "Summary",
           "TrialDir", "atomic_file", "atomic_write", "read_json", "read_jsonl",
           "read_jsonl_tail", "rng_state", "set_rng_state", "write_json", "write_yaml"]
