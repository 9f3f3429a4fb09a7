"""Each rank of tests/train/test_fsdp.py's launches (forked with torchrun's environment,
tests/ranks.py): every trial it is given trained in this one launch, one after another, by
`harness train CONFIG --out OUT`, each in a process group of its own (a port of its own: the
store a group leaves behind stays with its watchdog). `--stop N`: the last rank asks for a stop
after step N, as a SIGINT to it does (the signal itself: the test's stop_after)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness import distributed
from harness.cli import main as harness
from harness.config import read_yaml
from harness.methods.resolve import load_run
from harness.train import train

HEADER = "== trial "  # rank 0 starts each trial's output with it and the trial's folder


def say(line: str) -> None:
    """`line` in one write: the ranks share one unbuffered pipe, where `print` writes the text
    and its newline apart and another rank's line can land between them."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """`argv`: [--stop N] then each run config (YAML) and its group's port; each trial's
    folder is its config's path without the suffix. Non-zero as soon as a trial fails."""
    stop = int(argv[1]) if argv[:1] == ["--stop"] else None
    pairs = argv[2:] if stop is not None else argv
    last = distributed.rank() == distributed.world_size() - 1
    for path, port in zip(map(Path, pairs[::2]), pairs[1::2], strict=True):
        os.environ["MASTER_PORT"] = port
        out = path.with_suffix("")
        if distributed.is_main():
            say(f"{HEADER}{out}")
        if stop is None:
            if code := harness(["train", str(path), "--out", str(out)]):
                return code
            continue
        summary = train(load_run(read_yaml(path)), out,
                        should_stop=(lambda step: step >= stop) if last else None)
        say(f"{out}: {summary['status']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
