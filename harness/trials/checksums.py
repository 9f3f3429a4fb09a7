"""What a checkpoint's record checks: each file's (or byte range's) size and sha256, hashed as
torch.save writes it, and the one-line error of a checkpoint that could not be written."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

CHUNK = 1 << 20


class CheckpointError(Exception):
    """A checkpoint that could not be written, or a folder none of whose checkpoints loads:
    one line, naming the file or folder and the reason."""


class _Hashing:
    """The file torch.save writes through: hashes and counts the bytes as they pass, and keeps
    the OSError of a failed write (torch reports it as an opaque RuntimeError)."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha, self.bytes = file, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        self.bytes += written
        return written

    def flush(self) -> None:
        self.file.flush()


def write_state(path: Path, state: Any) -> dict[str, Any]:
    """torch.save `state` to `path` and fsync it; returns its record ({"sha256", "bytes"}),
    hashed as the bytes pass. A failed write raises its own OSError, not torch's opaque
    RuntimeError around it."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        try:
            torch.save(state, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": out.sha.hexdigest(), "bytes": out.bytes}


def digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return {"sha256": sha.hexdigest(), "bytes": path.stat().st_size}


def range_sha(f: Any, offset: int, length: int) -> str:
    """The sha256 of `length` bytes of the open file `f` from `offset`."""
    sha, left = hashlib.sha256(), length
    f.seek(offset)
    while left > 0:
        chunk = f.read(min(left, CHUNK))
        if not chunk:
            break
        sha.update(chunk)
        left -= len(chunk)
    return sha.hexdigest()


def differs(path: Path, want: dict[str, Any], name: str) -> str | None:
    where = f"{name}: " if name else ""
    if not path.is_file():
        return f"{where}missing"
    size = path.stat().st_size
    if size != want.get("bytes"):
        return f"{where}{size} bytes where {want.get('bytes')} were written"
    if digest(path)["sha256"] != want.get("sha256"):
        return f"{where}its sha256 is not the one written"
    return None
