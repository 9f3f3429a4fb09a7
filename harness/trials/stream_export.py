"""A final model's safetensors files written one tensor at a time, each read from the
checkpoint only as it is written: the host holds one tensor (and what its read needs), not the
model.

transformers' `save_pretrained` of the model's skeleton (its weights on the meta device)
decides, as for any model, which tensors go in which file (tied weights once, shards past
`max_shard_size`, the index beside them) and writes the configs; `streaming` gives it a file
writer that takes the header (names, dtypes, shapes, offsets) from the skeleton, writes it, then
each tensor's bytes as `read` returns them. The files are byte for byte those safetensors'
`save_file` writes of the whole state dict.

A model whose method's export changes it (adapters merged, weights dequantized, factors
multiplied out) is read `ByUnit`: the units are its decoder layers and the modules beside them
(`units`); each unit's exported tensors are computed when the first of them is asked for and
held until a tensor of another unit is, so the host holds one unit's tensors, not the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

Read = Callable[[str, torch.Tensor], torch.Tensor]  # (name, its meta template) → it, on the host
Compute = Callable[[str], dict[str, torch.Tensor]]  # a unit's name → its exported tensors

# safetensors' dtype names, in the order of its Rust enum: a file holds the later dtypes first
DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
          torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
          torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
RANK = {name: i for i, name in enumerate(["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16",
                                          "I32", "U32", "F32", "F64", "I64"])}
ALIGN = 8  # the header is padded with spaces to a multiple of this


def header(tensors: Mapping[str, torch.Tensor],
           metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The file's first bytes (length and JSON header, as safetensors writes them) and the
    order its tensors' bytes follow in. ValueError for a dtype safetensors has no name for."""
    unknown = next((n for n, t in tensors.items() if t.dtype not in DTYPES), None)
    if unknown is not None:
        raise ValueError(f"{unknown}: dtype {tensors[unknown].dtype} has no safetensors name")
    order = sorted(tensors, key=lambda n: (-RANK[DTYPES[tensors[n].dtype]], n))
    entries: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % ALIGN)
    return struct.pack("<Q", len(text)) + text, order


def write_file(path: Path | str, tensors: Mapping[str, torch.Tensor],
               metadata: dict[str, str] | None, read: Read) -> None:
    """A safetensors file of `tensors` (templates: their dtypes and shapes), each tensor's
    bytes `read` when its turn comes and dropped once written."""
    head, order = header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            want = tensors[name]
            got = read(name, want)
            if got.dtype != want.dtype or got.shape != want.shape:
                raise ValueError(f"{name}: read as {got.dtype} {tuple(got.shape)}, "
                                 f"{want.dtype} {tuple(want.shape)} expected")
            f.write(got.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del got


class Lazy(Mapping[str, torch.Tensor]):
    """The tensors a streamed model holds, each read when asked for (a final model's read-back
    check compares them one at a time); `same` tells tied names apart as data_ptr does."""

    def __init__(self, templates: Mapping[str, torch.Tensor], read: Read,
                 same: Callable[[str], object]) -> None:
        self.templates, self.read, self.same = templates, read, same

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name, self.templates[name])

    def __contains__(self, name: object) -> bool:
        return name in self.templates

    def __iter__(self) -> Iterator[str]:
        return iter(self.templates)

    def __len__(self) -> int:
        return len(self.templates)


class ByUnit:
    """A `Read` of an exported model's tensors, computed a unit at a time: `owner` names each
    tensor's unit, `compute` gives all of a unit's tensors; the last unit computed is held
    (a file's tensors come in name order, a unit's together) and freed before the next."""

    def __init__(self, owner: Mapping[str, str], compute: Compute) -> None:
        self.owner, self.compute = owner, compute
        self.unit: str | None = None
        self.held: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, like: torch.Tensor) -> torch.Tensor:
        unit = self.owner[name]
        if unit != self.unit:
            self.held, self.unit = {}, None  # dropped first: one unit on the host at a time
            self.held, self.unit = self.compute(unit), unit
        return self.held[name]


def units(model: nn.Module, layers: nn.Module) -> list[str]:
    """The names of `model`'s units: each of the `layers` (a ModuleList inside it), and each
    module beside the modules that lead to them (embeddings, final norm, heads)."""
    path = next(name for name, m in model.named_modules() if m is layers)
    found, module, prefix = [], model, ""
    for part in path.split("."):
        found += [prefix + name for name, _ in module.named_children() if name != part]
        module, prefix = module.get_submodule(part), f"{prefix}{part}."
    return found + [f"{path}.{name}" for name, _ in layers.named_children()]


@contextmanager
def streaming(read: Read) -> Iterator[None]:
    """transformers' `save_pretrained` writing each safetensors file with `write_file`: the
    state dict it passes is the skeleton's (meta tensors), `read` gives their values."""
    from transformers import modeling_utils

    def save_file(tensors: dict[str, torch.Tensor], filename: str,
                  metadata: dict[str, str] | None = None) -> None:
        write_file(filename, tensors, metadata, read)

    whole = modeling_utils.safe_save_file
    modeling_utils.safe_save_file = save_file  # the one name save_pretrained writes through
    try:
        yield
    finally:
        modeling_utils.safe_save_file = whole
