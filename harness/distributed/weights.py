"""A model's weight files as from_pretrained finds them (a local folder, or a hub model's
snapshot in the local Hugging Face cache), opened lazily so that a rank reads only its rows of
each tensor: safetensors by `get_slice`, PyTorch `.bin` files memory-mapped (`torch.load(...,
mmap=True)`), either one file or shards named by an index."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.config.hub import offline
from harness.distributed.materialize import Unsupported
from harness.errors import brief

# from_pretrained's names, in its order of preference: safetensors before pickles.
FILES = (("model.safetensors", "model.safetensors.index.json"),
         ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def hub_folder(name: str) -> Path | None:
    """A hub model's snapshot folder in the local Hugging Face cache, at the revision
    from_pretrained reads: `main` as the hub names it now (its small json files fetched),
    or, where the hub cannot be reached, as the cache last saw it. None: not cached."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json"],
                                      local_files_only=offline() is not None))
    except Exception:  # not cached, not reachable, or not a repository id: nothing to read
        return None


def weight_files(folder: Path) -> list[Path] | None:
    """The files from_pretrained reads `folder`'s weights from; None: none it reads, or an
    index naming a shard the folder lacks."""
    for single, index in FILES:
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            names = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            shards = [folder / n for n in names]
            return shards if all(s.is_file() for s in shards) else None
    return None


@dataclass
class Part:
    """One stored tensor, unread: its shape and dtype, and a lazy row-slicer."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Any  # a safetensors slice, or a memory-mapped tensor: `source[lo:hi]` reads rows


class Weights:
    """Every tensor of `files` by name; `rows(name, lo, hi)` reads those rows alone (counted in
    `read_bytes`, in the file's dtype)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.read_bytes = 0
        self.parts: dict[str, Part] = {}
        for file in files:
            self.parts.update(_open(file))

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def floating_dtype(self) -> torch.dtype | None:
        """The files' floating-point dtype where they hold one alone (None: several, or none)."""
        found = {p.dtype for p in self.parts.values() if p.dtype.is_floating_point}
        return found.pop() if len(found) == 1 else None

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        part = self.parts[name]
        out = part.source[lo:hi]
        self.read_bytes += out.numel() * out.element_size()
        return out


def _open(file: Path) -> dict[str, Part]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        handle = safe_open(file, framework="pt")  # kept open by the slices it hands out
        parts, names = {}, handle.keys()  # a handle, not a dict: it does not iterate
        for name in names:
            piece = handle.get_slice(name)
            dtype = _SAFE_DTYPES[piece.get_dtype()]
            parts[name] = Part(tuple(piece.get_shape()), dtype, piece)
        return parts
    try:
        state = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # a legacy (not zip) file maps not at all; a bad one fails whole too
        raise Unsupported(f"{file.name} does not map lazily ({brief(e)})") from None
    return {k: Part(tuple(v.shape), v.dtype, v) for k, v in state.items()
            if isinstance(v, torch.Tensor)}


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
