"""One rank of a `harness bench fsdp` trial, started by torchrun (`python -m
harness.bench.fsdp_rank CONFIG OUT`): the trial's steps as `harness train` runs them, with
each rank's peak of live tensors in step 3 (harness/cost/tensor_peak.py, as a CPU trial records
it), the seconds of the steps from step 5 on but the last, and one more step in which every
collective is counted (harness/bench/comm.py); rank 0 writes every rank's figures to
OUT/bench.json."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from harness import distributed
from harness.bench.comm import CommCounter
from harness.cost.profile import SKIPPED
from harness.cost.tensor_peak import PEAK, tracked
from harness.distributed import fsdp
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records


def measure(config: Path, out: Path) -> dict[str, Any] | None:
    """This rank's figures, every rank's on rank 0 (None on the others)."""
    run = load_run(yaml.safe_load(config.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(run, distributed.main_only(Records(out, run)), lambda step: False, None)
    ends: list[float] = []
    trainer.hooks.on("step_end", lambda step: ends.append(time.perf_counter()))
    with tracked(trainer):
        trainer.fit()
    # the steps after the profiled one (step SKIPPED + 1) and the next (in which the profiler
    # hands its recording over), less the last (its evaluation and checkpoint): ends[i] is
    # step i + 1's end
    steps = [b - a for a, b in zip(ends[SKIPPED + 1 : -2], ends[SKIPPED + 2 : -1], strict=True)]
    with CommCounter() as counted:
        trainer.train_step()
    mine = {"peak_bytes": trainer.costs.get(PEAK), "sent_bytes": counted.sent,
            "payload_bytes": dict(counted.payload), "calls": dict(counted.calls),
            "param_bytes": sum(fsdp.local(p).numel() * p.element_size()
                               for p in trainer.model.parameters()),
            "step_s": statistics.median(steps) if steps else None}
    ranks = distributed.every_rank(mine)
    shards = trainer.steps.shards
    trainer.close()
    if not distributed.is_main():
        return None
    return {"world": trainer.steps.world, "shards": shards, "tokens": trainer.steps.tokens,
            "step_s": ranks[0]["step_s"], "ranks": ranks}


def main(argv: list[str]) -> int:
    config, out = map(Path, argv)
    try:
        figures = measure(config, out)
    finally:
        distributed.teardown()
    if figures is not None:
        (out / "bench.json").write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
