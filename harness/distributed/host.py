"""Collectives on host memory, off the training step's critical path: a gloo group of their own
(beside a trainer on NCCL too), and a flag every rank agrees on one step late."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.distributed import TIMEOUT, active


def host_group() -> Any:
    """A new gloo group of every rank for host tensors; None in one process. Each thread that
    issues collectives needs its own: every rank must issue a group's collectives in one order.
    Every rank creates its groups in the same order (torch's rule for `new_group`)."""
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if active() else None


class LateFlag:
    """A flag true on every rank when it was true on one, without a host sync in the step: the
    all-reduce of step n's flags starts at step n and is read at step n+1, a step after every
    rank issued it (on gloo each rank has passed step n+1's gradient reduction by then), so the
    wait holds no device work. A stop then takes effect one step after it is asked, on every
    rank alike. One process: at once."""

    def __init__(self) -> None:
        self.group = host_group()
        self.value = np.zeros(1, dtype=np.float32)  # the all-reduce's buffer, read as an array
        self.pending: Any = None

    def agree(self, flag: bool, last: bool = False) -> bool:
        """The flags offered at the previous call, agreed; `flag` is offered for the next
        (not after the `last` call: nothing would read it)."""
        if self.group is None:
            return flag
        agreed = False
        if self.pending is not None:
            self.pending.wait()
            self.pending, agreed = None, bool(self.value[0] > 0)
        if not last:
            self.value[0] = float(flag)
            self.pending = dist.all_reduce(torch.from_numpy(self.value), group=self.group,
                                           async_op=True)
        return agreed
