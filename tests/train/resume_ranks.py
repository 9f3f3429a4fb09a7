"""Each rank of tests/train/test_fsdp.py's resumes at another world size (forked with torchrun's
environment, tests/ranks.py): every trial it is given trained in this one launch, one after
another, as `harness train CONFIG --out OUT` trains it, each in a process group of its own (a
port of its own: the store a group leaves behind stays with its watchdog). `--stop N`: the last
rank asks for a stop after step N, as a SIGINT to it does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness import distributed
from harness.config import read_yaml
from harness.methods.resolve import load_run
from harness.train import train


def main(argv: list[str]) -> int:
    """`argv`: [--stop N] then each run config (YAML) and its group's port; each trial's
    folder is its config's path without the suffix."""
    stop = int(argv[1]) if argv[:1] == ["--stop"] else None
    pairs = argv[2:] if stop is not None else argv
    last = distributed.rank() == distributed.world_size() - 1
    for path, port in zip(map(Path, pairs[::2]), pairs[1::2], strict=True):
        os.environ["MASTER_PORT"] = port
        should_stop = (lambda step: step >= stop) if stop is not None and last else None
        out = path.with_suffix("")
        summary = train(load_run(read_yaml(path)), out, should_stop=should_stop)
        print(f"{out}: {summary['status']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
