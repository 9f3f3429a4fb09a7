"""`harness` whose rank 1 hits a bug of its own at step 3 (tests/train/test_peer_faults.py):
its peers must record that failure, not a lost peer."""

from __future__ import annotations

import os

from harness.cli import main as harness_main
from harness.train.loop import Trainer

STEP = 5  # after the step a CPU trial profiles (3), whose end every rank meets


def main(argv: list[str]) -> int:
    if os.environ.get("RANK") == "1":
        step = Trainer.train_step

        def broken(self: Trainer) -> object:
            if self.step + 1 == STEP:
                raise ValueError(f"a bug of rank 1's own at step {STEP}")
            return step(self)

        Trainer.train_step = broken  # type: ignore[method-assign]
    return harness_main(argv)
