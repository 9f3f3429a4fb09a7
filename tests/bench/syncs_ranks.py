"""Each rank of tests/bench/test_syncs_ranks.py's runs, forked with torchrun's environment
(tests/ranks.py): host reads per steady step (harness/bench/syncs.py's counter, the step's
events included) as `rank-<r>.json` in the folder it is given, one record a run config."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from harness import distributed
from harness.bench.syncs import count_reads
from harness.methods.resolve import load_run

STEPS = 3  # counted, after the counter's warm-up steps


def main(argv: list[str]) -> int:
    folder, configs = Path(argv[0]), argv[1:]
    records = []
    try:
        for config in configs:
            sites, _ = count_reads(load_run(yaml.safe_load(Path(config).read_text())), STEPS)
            records.append({"config": config, "reads": sum(sites.values()) / STEPS,
                            "sites": {s: n / STEPS for s, n in sites.items()}})
    finally:
        distributed.teardown()
    (folder / f"rank-{distributed.rank()}.json").write_text(json.dumps(records))
    return 0
