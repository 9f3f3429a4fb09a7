"""A trial's checkpoints: the newest `keep` of them, each written whole or not at all, each
with its size and sha256 beside it, read back newest first.

    checkpoint/state.pt         the newest
    checkpoint/state.pt.json    its {"sha256", "bytes"}, written after it
    checkpoint/state-<n>.pt     older ones, the higher n the newer (each with its .json)
    checkpoint/*.corrupt        ones that failed to verify or load, set aside on resume

A save writes a temp file, fsyncs it and only then moves the newest aside and renames the temp
file into its place, so a kill or a full disk at any instant leaves the previous checkpoint
whole. A load skips a checkpoint whose bytes differ from what was written, or that torch cannot
read, for the one before it: a bad block or a torn write costs the steps since that one, not the
trial. A checkpoint without its record (one written before records existed, or a kill between
the rename and the record) is loaded unverified: it was fsynced before its rename.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import brief
from harness.trials.files import fsync_dir, read_json, write_json

NEWEST = "state.pt"
OLDER = re.compile(r"state-([0-9]+)\.pt")
CHUNK = 1 << 20


class CheckpointError(Exception):
    """A checkpoint that could not be written, or a folder none of whose checkpoints loads:
    one line, naming the file or folder and the reason."""


@dataclass(frozen=True)
class Loaded:
    """The newest checkpoint that loads, and the newer ones skipped on the way, with why."""

    path: Path
    state: dict[str, Any]
    skipped: list[tuple[Path, str]]


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


def record_of(path: Path) -> Path:
    """The checkpoint's record of its size and sha256."""
    return path.with_name(path.name + ".json")


def files(folder: Path) -> list[Path]:
    """The checkpoints in `folder`, newest first; [] for none (or no folder)."""
    older = sorted(((int(m[1]), p) for p in _listing(folder) if (m := OLDER.fullmatch(p.name))),
                   reverse=True)
    newest = folder / NEWEST
    return ([newest] if newest.is_file() else []) + [p for _, p in older]


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []


def save(folder: Path, state: dict[str, Any], keep: int) -> None:
    """Write `state` as the newest checkpoint and keep the `keep` newest; CheckpointError
    (one line) when it cannot be written, the previous checkpoints then as they were."""
    newest = folder / NEWEST
    tmp = folder / f".{NEWEST}.tmp{os.getpid()}"
    out = _Hashing(None)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{NEWEST}.tmp*"):  # a writer killed mid-save left it
            stale.unlink(missing_ok=True)
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            torch.save(state, out)
            f.flush()
            os.fsync(f.fileno())
        if newest.exists():
            _move_aside(folder, newest)
        record_of(newest).unlink(missing_ok=True)  # a record beside state.pt describes it
        os.replace(tmp, newest)
        fsync_dir(folder)
        write_json(record_of(newest), {"sha256": out.sha.hexdigest(), "bytes": out.bytes})
        for old in files(folder)[keep:]:
            record_of(old).unlink(missing_ok=True)  # the record first: data without one loads
            old.unlink()
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {newest} not saved: {brief(out.error or e)}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _move_aside(folder: Path, newest: Path) -> None:
    """The newest becomes the newest of the older ones, its record with it."""
    number = max((int(m[1]) for p in _listing(folder) if (m := OLDER.fullmatch(p.name))),
                 default=0) + 1
    older = folder / f"state-{number}.pt"
    record_of(older).unlink(missing_ok=True)
    os.replace(newest, older)
    if record_of(newest).exists():
        os.replace(record_of(newest), record_of(older))


def load_newest(folder: Path) -> Loaded | None:
    """The newest checkpoint that verifies and loads; None where there is none at all;
    CheckpointError (one line, every file's reason) where none of them loads."""
    skipped: list[tuple[Path, str]] = []
    for path in files(folder):
        try:
            reason = _verify(path)
            state = None if reason else torch.load(path, map_location="cpu", weights_only=False)
        except MemoryError:
            raise
        except Exception as e:  # whatever a torn or foreign file makes torch raise
            reason, state = brief(e), None
        if isinstance(state, dict):
            return Loaded(path, state, skipped)
        skipped.append((path, reason or f"holds a {type(state).__name__}, not a checkpoint"))
    if not skipped:
        return None
    reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise CheckpointError(f"no checkpoint in {folder} loads ({reasons}); delete that folder to "
                          "start the trial over")


def _verify(path: Path) -> str | None:
    """Why the file is not the one written (None: it is, or it has no record to check)."""
    record = read_json(record_of(path)) or {}
    if "sha256" not in record:
        return None
    size = path.stat().st_size
    if size != record.get("bytes"):
        return f"{size} bytes where {record.get('bytes')} were written"
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return None if sha.hexdigest() == record.get("sha256") else "its sha256 is not the one written"


def set_aside(path: Path) -> Path:
    """Move a checkpoint that failed to load out of the rotation, kept for a look."""
    moved = path.with_name(path.name + ".corrupt")
    record_of(path).unlink(missing_ok=True)
    os.replace(path, moved)
    return moved
