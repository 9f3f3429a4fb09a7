"""Each rank of tests/train/test_equality.py's launches (forked with torchrun's environment,
tests/ranks.py): every run config it is given trained in this one process group, one after
another, and what rank 0 measured written as `<config stem>.pt` beside the configs. The test's
one-process references run `measure` in the test process."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from harness import distributed
from harness.config import RunConfig
from harness.distributed import fsdp
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records


def measure(run: RunConfig) -> dict[str, Any]:
    """Each step's loss (summed over ranks), the eval loss after the last step, the final
    weights (and which of them are integer codes) and optimizer states whole, the last step's
    gradient norm and rank 0's weight bytes: what a trial trained by `run` in this process
    group ends with."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, distributed.main_only(Records(Path(out), run)),
                          lambda step: False, None)
        try:
            losses = []
            for _ in range(run.train.steps):
                losses.append(distributed.all_sum(trainer.train_step().detach()))
                trainer.step += 1
            eval_loss = trainer.evaluate()["eval_loss"]
            weights = trainer.model.state_dict()
            result = {"losses": torch.stack(losses).tolist(),
                      "eval": eval_loss,
                      "weights": {k: fsdp.full(v).detach().float().clone()
                                  for k, v in weights.items()},
                      # quantized weights (Q-GaLore's INT8): their values are codes
                      "codes": sorted(k for k, v in weights.items() if not v.is_floating_point()),
                      "states": flat(trainer.optimizer.state_dict()),
                      # the last step's pre-clip norm (none layer-wise); this rank's bytes
                      "grad_norm": None if trainer.grad_norm is None
                      else float(fsdp.full(trainer.grad_norm)),
                      "param_bytes": trainer.costs["param_bytes"]}
        finally:
            trainer.close()
    return result


def flat(state: Any, key: str = "") -> dict[str, torch.Tensor]:
    """An optimizer's state_dict as its tensors by path, each whole (sharded ones gathered,
    quantized ones dequantized)."""
    if isinstance(state, torch.Tensor):
        whole = fsdp.full(state)
        if hasattr(whole, "dequantize"):  # torchao's quantized moments, as float values
            whole = whole.dequantize()
        return {key: whole.detach().clone()}
    if isinstance(state, dict):
        state = state.items()
    elif isinstance(state, list | tuple):
        state = enumerate(state)
    else:
        return {}
    return {k: v for name, sub in state for k, v in flat(sub, f"{key}/{name}").items()}


def main(argv: list[str]) -> int:
    """`argv`: the run configs (YAML); results beside each."""
    for path in map(Path, argv):
        result = measure(load_run(yaml.safe_load(path.read_text())))
        if distributed.is_main():
            torch.save(result, path.with_suffix(".pt"))
        distributed.barrier()
    return 0


if __name__ == "__main__":  # under torchrun: scripts/equality_table.py
    raise SystemExit(main(sys.argv[1:]))
