"""Run under torchrun by tests/cost/test_sharded.py: each rank's peak of live tensor bytes in
a steady fsdp step, for each run config named after the output folder, as one JSON line a
config in the folder's `rank-<r>.jsonl`. Without accumulation torch's own FSDP2 memory
tracker (`FSDPMemTracker`) measures it; it refuses a second forward in one step, so with
accumulation the profiler's memory timeline does (harness/cost/tensor_peak.py), a step again
on every rank where its analysis fails on one (it asserts on some graphs)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from harness import distributed
from harness.cost.profile import profiler
from harness.cost.tensor_peak import _peak
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records


def tracked(trainer: Trainer) -> int:
    with FSDPMemTracker(trainer.model, trainer.optimizer) as tracker:
        trainer.train_step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def profiled(trainer: Trainer) -> int | None:
    """Measured on every rank in one step: a rank's timeline analysis fails now and then (about
    one step in four here), so up to 8 steps are tried."""
    for _ in range(8):
        with profiler(1, trainer.device, memory=True, skipped=0) as prof:
            trainer.train_step()
            prof.step()
        try:
            peak = _peak(prof._memory_profile())[0]
        except AssertionError:  # torch's data-flow analysis: "version mismatch"
            peak = None
        if all(distributed.every_rank(peak)):
            return peak
    return None


def main(results: Path, configs: list[str]) -> None:
    for path in configs:
        run = load_run(yaml.safe_load(Path(path).read_text()))
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(run, distributed.main_only(Records(Path(out), run)),
                              lambda step: False, None)
            for _ in range(2):  # warm: states exist, as in the step a trial records
                trainer.train_step()
            peak = profiled(trainer) if trainer.steps.accumulation > 1 else tracked(trainer)
            with open(results / f"rank-{distributed.rank()}.jsonl", "a") as f:
                f.write(json.dumps({"config": path, "rank": distributed.rank(), "peak": peak})
                        + "\n")
            distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
