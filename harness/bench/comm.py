"""Bytes a rank sends in collectives, counted as they run: a dispatch mode that sees every
c10d collective (DDP's bucketed all-reduce from C++, FSDP2's all-gathers and reduce-scatters,
the harness's own all-reduces and broadcasts) and the functional ones DTensor issues (a sharded
gradient norm's all-reduce, a gathered `full_tensor`).

A collective is counted as the bytes a rank sends under the ring algorithm gloo and NCCL use
for large tensors, from its payload N (an all-gather's output, a reduce-scatter's input, an
all-reduce's or broadcast's tensors) over a group of G ranks: (G-1)/G·N for an all-gather or
a reduce-scatter, 2(G-1)/G·N for an all-reduce, (G-1)/G·N for a broadcast (pipelined); the
payloads are kept too, by collective.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# collective -> (index of its payload argument, how many times (G-1)/G of it a rank sends)
C10D = {"_allgather_base_": (0, 1), "allgather_": (0, 1), "allgather_coalesced_": (0, 1),
        "allgather_into_tensor_coalesced_": (0, 1), "_reduce_scatter_base_": (1, 1),
        "reduce_scatter_": (1, 1), "reduce_scatter_tensor_coalesced_": (1, 1),
        "allreduce_": (0, 2), "allreduce_coalesced_": (0, 2), "broadcast_": (0, 1)}
# functional collectives: (payload argument, sends, whether the payload is G times the input)
FUNCTIONAL = {"all_gather_into_tensor": (0, 1, True), "reduce_scatter_tensor": (0, 1, False),
              "all_reduce": (0, 2, False), "broadcast": (0, 1, False)}


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


def _group_size(args: tuple[Any, ...]) -> int:
    """The size of the group a collective's arguments name: a ProcessGroup (c10d ops, boxed)
    or a group's name (functional ops); the world's when neither is found."""
    for a in reversed(args):  # a functional op's group name comes last (its op is a str too)
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).size()
        if isinstance(a, str):
            return dist.distributed_c10d._resolve_process_group(a).size()
    return dist.get_world_size()


class CommCounter(TorchDispatchMode):
    """Inside it, `sent` adds up the bytes this rank sends and `payload` each collective's
    payload bytes, by collective name; `calls` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0.0
        self.payload: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # DTensor turns into plain ops, seen next
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name in C10D:
            at, sends = C10D[name]
            self._add(name, _bytes(args[at]), _group_size(args), sends)
        elif func.namespace == "_c10d_functional" and name in FUNCTIONAL:
            at, sends, gathered = FUNCTIONAL[name]
            size = _group_size(args)
            self._add(name, _bytes(args[at]) * (size if gathered else 1), size, sends)
        return out

    def _add(self, name: str, payload: int, group: int, sends: int) -> None:
        self.payload[name] += payload
        self.calls[name] += 1
        self.sent += sends * (group - 1) / group * payload
