"""Each rank of tests/methods/test_sharded_work.py, forked with torchrun's environment
(tests/ranks.py): what it spends on the optimizer's whole-matrix work in the first training step
of each run config, as one JSON line a config in the results folder's `rank-<r>.jsonl`: the
Newton–Schulz flops (torch's FlopCounterMode around each iteration), the SVDs' m·n·min(m, n),
the bytes it sends to and receives from other ranks in each all-to-all, the objects it
broadcasts pickled, the bytes of the bases and states it keeps (the method's `measure`), and of
the down projections' moments (GaLore's left sides: 64×176, r×176 moments); and the losses of
STEPS steps, summed over the ranks."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils.flop_counter import FlopCounterMode

from harness import distributed
from harness.distributed.rows import Rows
from harness.methods import muon
from harness.methods.base import memory_of
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records

STEPS = 3  # GaLore refreshing every step: the moments rotated into a new basis twice


class Counts:
    """This rank's whole-matrix work while entered: the functions it goes through patched."""

    def __init__(self) -> None:
        self.ns_flops = self.svd_flops = self.pickled = 0
        self.trips: list[int] = []  # bytes sent to and received from the others, per all-to-all

    def __enter__(self) -> Counts:
        self.saved = (muon._zeropower_via_newtonschulz, torch.linalg.svd,
                      dist.all_to_all_single, dist.broadcast_object_list)
        ns, svd, a2a, pickled = self.saved

        def counted_ns(x: torch.Tensor, *args: Any) -> torch.Tensor:
            with FlopCounterMode(display=False) as flops:
                out = ns(x, *args)
            self.ns_flops += flops.get_total_flops()
            return out

        def counted_svd(a: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            m, n = a.shape
            self.svd_flops += m * n * min(m, n)
            return svd(a, *args, **kwargs)

        def counted_a2a(out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int],
                        in_sizes: list[int], group: Any = None, async_op: bool = False) -> Any:
            me, size = dist.get_rank(group), inp.element_size()
            self.trips.append(size * (sum(in_sizes) - in_sizes[me]
                                      + sum(out_sizes) - out_sizes[me]))
            return a2a(out, inp, out_sizes, in_sizes, group=group, async_op=async_op)

        def counted_pickled(*args: Any, **kwargs: Any) -> Any:
            self.pickled += 1
            return pickled(*args, **kwargs)

        muon._zeropower_via_newtonschulz = counted_ns
        torch.linalg.svd = counted_svd
        dist.all_to_all_single = counted_a2a
        dist.broadcast_object_list = counted_pickled
        return self

    def __exit__(self, *exc: object) -> None:
        (muon._zeropower_via_newtonschulz, torch.linalg.svd, dist.all_to_all_single,
         dist.broadcast_object_list) = self.saved


def left_moments(trainer: Trainer) -> int:
    """Bytes of this rank's Adam moments of the down projections."""
    state = trainer.optimizer.state
    return sum(Rows(t).local.numel() * t.element_size()
               for name, p in trainer.model.named_parameters() if name.endswith("down_proj.weight")
               for key, t in state.get(p, {}).items() if key in ("exp_avg", "exp_avg_sq"))


def main(argv: list[str]) -> int:
    """`argv`: the results folder, then the run configs."""
    results, configs = Path(argv[0]), argv[1:]
    for path in configs:
        run = load_run(yaml.safe_load(Path(path).read_text()))
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(run, distributed.main_only(Records(Path(out), run)),
                              lambda step: False, None)
            with Counts() as counts:  # the first step: Muon's iteration, GaLore's refresh
                losses = [trainer.train_step()]
            losses += [trainer.train_step() for _ in range(STEPS - 1)]
            kept = memory_of(trainer.method).measure(trainer.model, trainer.optimizer)
            line = {"config": Path(path).stem, "rank": distributed.rank(),
                    "ns_flops": counts.ns_flops, "svd_flops": counts.svd_flops,
                    "trips": counts.trips, "pickled": counts.pickled,
                    "extra_bytes": kept.extra_bytes, "state_bytes": kept.optimizer_state_bytes,
                    "left_moments": left_moments(trainer),
                    "losses": distributed.all_sum(torch.stack(losses).detach()).tolist()}
            with open(results / f"rank-{distributed.rank()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            distributed.barrier()
    return 0
