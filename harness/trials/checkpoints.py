"""A trial's checkpoints: the newest `keep` of them, each written whole or not at all, each
with its size and sha256 beside it, read back newest first.

    checkpoint/state.pt         the newest
    checkpoint/state.pt.json    its {"sha256", "bytes"}, written after it
    checkpoint/state-<n>.pt     older ones, the higher n the newer (each with its .json)
    checkpoint/*.corrupt        ones that failed to verify or load, set aside on resume

A sharded trial's checkpoint (fsdp) is a folder of the same names (harness/trials/sharded.py):
each rank writes its shards with torch.distributed.checkpoint and rank 0 the rest; its record
holds the sha256 of each byte range written, which a resume checks as it reads them.

A save writes a temp file, fsyncs it and only then moves the newest aside and renames the temp
file into its place, so a kill or a full disk at any instant leaves the previous checkpoint
whole. A load skips a checkpoint whose bytes differ from what was written, or that torch cannot
read, for the one before it: a bad block or a torn write costs the steps since that one, not the
trial. A checkpoint without its record (one written before records existed, or a kill between
the rename and the record) is loaded unverified: it was fsynced before its rename.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import UserError, brief
from harness.trials import sharded
from harness.trials.checksums import CheckpointError, differs, write_state
from harness.trials.files import fsync_dir, read_json, write_json
from harness.trials.folder import NEWEST

OLDER = re.compile(r"state-([0-9]+)\.pt")
Read = Callable[[Path, dict[str, Any]], None]  # (checkpoint, its state): takes its tensors


@dataclass(frozen=True)
class Loaded:
    """The newest checkpoint that loads, and the newer ones skipped on the way, with why."""

    path: Path
    state: dict[str, Any]
    skipped: list[tuple[Path, str]]


def record_of(path: Path) -> Path:
    """The checkpoint's record of its size and sha256."""
    return path.with_name(path.name + ".json")


def files(folder: Path) -> list[Path]:
    """The checkpoints in `folder`, newest first; [] for none (or no folder)."""
    older = sorted(((int(m[1]), p) for p in _listing(folder) if (m := OLDER.fullmatch(p.name))),
                   reverse=True)
    newest = folder / NEWEST
    return ([newest] if newest.exists() else []) + [p for _, p in older]


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
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{NEWEST}.tmp*"):  # a writer killed mid-save left it
            stale.unlink(missing_ok=True)
        _publish(folder, tmp, write_state(tmp, state), keep)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {newest} not saved: {brief(e)}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _publish(folder: Path, tmp: Path, record: dict[str, Any], keep: int) -> None:
    """The fsynced `tmp` becomes the newest checkpoint, the one before it the newest older
    one, and only the `keep` newest stay."""
    newest = folder / NEWEST
    if newest.exists():
        _move_aside(folder, newest)
    record_of(newest).unlink(missing_ok=True)  # a record beside state.pt describes it
    os.replace(tmp, newest)
    fsync_dir(folder)
    write_json(record_of(newest), record)
    for old in files(folder)[keep:]:
        record_of(old).unlink(missing_ok=True)  # the record first: data without one loads
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_sharded(folder: Path, parts: dict[str, dict[str, Any]], rest: dict[str, Any], keep: int,
                 background: sharded.Background | None = None) -> None:
    """Called by every rank of a sharded trial: each writes its shards of each part (a DCP
    state dict) into one temporary folder; rank 0 adds `rest` and moves the folder into place
    as `save` moves a file (harness/trials/sharded.py). CheckpointError on every rank when any
    could not write. With `background`, the save in flight is published first, and this one
    at the next `background.wait()`."""
    import torch.distributed as dist

    if background is not None:
        background.wait()
    tmp = folder / f".{NEWEST}.tmp"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{NEWEST}.tmp*"):  # a save killed midway left it
            _remove(stale)
    dist.barrier()

    def publish(written: Path, record: dict[str, Any]) -> None:
        _publish(folder, written, record, keep)

    sharded.save(tmp, parts, rest, publish, background)


def _move_aside(folder: Path, newest: Path) -> None:
    """The newest becomes the newest of the older ones, its record with it."""
    number = max((int(m[1]) for p in _listing(folder) if (m := OLDER.fullmatch(p.name))),
                 default=0) + 1
    older = folder / f"state-{number}.pt"
    record_of(older).unlink(missing_ok=True)
    os.replace(newest, older)
    if record_of(newest).exists():
        os.replace(record_of(newest), record_of(older))


def load_newest(folder: Path, read: Read | None = None) -> Loaded | None:
    """The newest checkpoint that verifies and loads, `read` (when given) taking its tensors
    (a sharded one's, verified range by range as read: `sharded.Corrupt` skips it too); None
    where there is none at all; CheckpointError (one line, every file's reason) where none of
    them loads. UserError (a checkpoint of another format or layout) is not skipped: raised."""
    skipped: list[tuple[Path, str]] = []
    for path in files(folder):
        try:
            reason = _verify(path)
            state = None if reason else _load(path)
        except (MemoryError, UserError):
            raise
        except Exception as e:  # whatever a torn or foreign file makes torch raise
            reason, state = brief(e), None
        if isinstance(state, dict):
            try:
                if read is not None:
                    read(path, state)
                return Loaded(path, state, skipped)
            except sharded.Corrupt as e:  # on every rank alike: DCP gathers the failures
                reason = str(e)
        skipped.append((path, reason or f"holds a {type(state).__name__}, not a checkpoint"))
    if not skipped:
        return None
    reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise CheckpointError(f"no checkpoint in {folder} loads ({reasons}); delete that folder to "
                          "start the trial over")


def _load(path: Path) -> Any:
    """A file's state; a sharded checkpoint's `rest`, naming its folder as `sharded` for the
    trainer, which reads the shards into its own model and optimizer (`load_sharded`)."""
    if path.is_dir():
        if sharded.is_old(path):
            raise sharded.old_format(path)
        return {**torch.load(path / sharded.REST, map_location="cpu", weights_only=False),
                "sharded": path, "record": read_json(record_of(path)) or {}}
    return torch.load(path, map_location="cpu", weights_only=False)


def _verify(path: Path) -> str | None:
    """Why the file (or a sharded checkpoint's file) is not the one written (None: it is, or
    it has no record to check)."""
    record = read_json(record_of(path)) or {}
    if "files" in record:
        return sharded.verify_whole(path, record)
    if "sha256" not in record:
        return None
    return differs(path, record, "")


def set_aside(path: Path) -> Path:
    """Move a checkpoint that failed to load out of the rotation, kept for a look."""
    moved = path.with_name(path.name + ".corrupt")
    record_of(path).unlink(missing_ok=True)
    os.replace(path, moved)
    return moved
