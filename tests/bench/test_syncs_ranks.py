"""Host reads per steady step at 2 ranks (harness/bench/syncs.py's counter, each step's events
included: the stop agreement among them), under DDP, DDP with accumulation and fsdp."""

from __future__ import annotations

import json

from conftest import free_port, micro_run, write_yaml
from ranks import Ranks

CASES = {  # label -> train keys; 5 + 1 steps: the counted ones neither log, evaluate nor save
    "ddp": {"total_batch_size": 4},
    "ddp-accumulating": {"total_batch_size": 8},
    "fsdp": {"total_batch_size": 4, "parallel": "fsdp"},
}


def test_two_ranks_read_no_value_in_a_steady_step(tmp_path):
    """The stop flag agreed one step late (its all-reduce started at step n on a gloo group,
    read at n+1 from a host buffer): no read of a tensor's value left in the step."""
    configs = [write_yaml(tmp_path / f"{label}.yaml",
                          {**micro_run(steps=6, log_every=6, **train), "eval": {"tokens": 64}})
               for label, train in CASES.items()]
    done = Ranks([str(tmp_path), *map(str, configs)], 2, free_port(), "syncs_ranks")
    log, _ = done.communicate(timeout=300)
    assert done.returncode == 0, log
    records = [r for rank in (0, 1)
               for r in json.loads((tmp_path / f"rank-{rank}.json").read_text())]
    assert len(records) == 2 * len(CASES)
    print("\n".join(f"{r['config']}: {r['reads']:g} reads/step {r['sites']}" for r in records))
    assert all(r["reads"] == 0 for r in records), records
