"""Each rank of tests/cost/test_sharded.py's fsdp runs, forked with torchrun's environment
(tests/ranks.py): its peak of live tensor bytes in a steady fsdp step, for each run config
named after the output folder, as one JSON line a config in the folder's `rank-<r>.jsonl`.
Without accumulation torch's own FSDP2 memory tracker (`FSDPMemTracker`) measures it; it
refuses a second forward in one step, so with accumulation the profiler's memory timeline does
(harness/cost/tensor_peak.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import yaml
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from harness import distributed
from harness.cost.profile import profiler
from harness.cost.tensor_peak import _peak, _timeline
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records


def tracked(trainer: Trainer) -> int:
    with FSDPMemTracker(trainer.model, trainer.optimizer) as tracker:
        trainer.train_step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


# Steps profiled with accumulation: the lowest peak counts. FSDP2 reduce-scatters each
# micro-batch's gradients asynchronously, and on gloo its input (llama_micro's root group:
# embedding, head and norm, 4,194,560 bytes) is sometimes still held when the next one is
# made, as the collective's thread finishes: measured in about one rank-step in four, on
# either rank, always that one buffer. The estimate is the step without that overlap.
PROFILED_STEPS = 5


def profiled(trainer: Trainer) -> int:
    """Measured on every rank, as `tracked` in harness/cost/tensor_peak.py reads a trial's
    (torch's own data-flow analysis, which asserted on about one rank-step in four here, is
    not used): the lowest of PROFILED_STEPS steps' peaks."""
    peaks = []
    for _ in range(PROFILED_STEPS):
        with profiler(1, trainer.device, memory=True, skipped=0) as prof:
            trainer.train_step()
            prof.step()
        peaks.append(_peak(_timeline(prof))[0])
    return min(peaks)


def main(argv: list[str]) -> int:
    """`argv`: the results folder, then the run configs."""
    results, configs = Path(argv[0]), argv[1:]
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
    return 0
