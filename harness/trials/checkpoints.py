"""A trial's checkpoints: the newest `keep` of them, each written whole or not at all, each
with its size and sha256 beside it, read back newest first.

    checkpoint/state.pt         the newest
    checkpoint/state.pt.json    its {"sha256", "bytes"}, written after it
    checkpoint/state-<n>.pt     older ones, the higher n the newer (each with its .json)
    checkpoint/*.corrupt        ones that failed to verify or load, set aside on resume

A sharded trial's checkpoint (fsdp) is a folder of the same names: each rank writes its shards
with torch.distributed.checkpoint (`__<rank>_0.distcp`, `.metadata`) and rank 0 the rest
(`rest.pt`); its record holds every file's sha256 and size (`save_sharded`).

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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import brief
from harness.trials.files import fsync_dir, read_json, write_json

NEWEST = "state.pt"
REST = "rest.pt"  # in a sharded checkpoint's folder: everything but the sharded tensors
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
        _publish(folder, tmp, _write(tmp, state), keep)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {newest} not saved: {brief(e)}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, state: Any) -> dict[str, Any]:
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


def save_sharded(folder: Path, tensors: dict[str, Any], rest: dict[str, Any], keep: int) -> None:
    """Called by every rank of a sharded trial: each writes its shards of `tensors` (flat:
    name to tensor or DTensor) with torch.distributed.checkpoint into one temporary folder and
    fsyncs them; rank 0 adds `rest`, hashes every file and moves the folder into place as
    `save` moves a file. CheckpointError on every rank when any could not write."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, tmp, error = dist.get_rank(), folder / f".{NEWEST}.tmp", None
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".{NEWEST}.tmp*"):  # a save killed midway left it
            _remove(stale)
    dist.barrier()
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        mine = {p.name: digest(p) for p in tmp.glob(f"__{rank}_*")}
    except Exception as e:  # DCP raises its own CheckpointException, on every rank alike
        error, mine = f"checkpoint {folder / NEWEST} not saved: {brief(e)}", {}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (error, mine))
    errors = [e for e, _ in every if e]
    if rank == 0 and not errors:
        try:
            record = {k: v for _, digests in every for k, v in digests.items()}
            record[REST] = _write(tmp / REST, rest)
            record[".metadata"] = digest(tmp / ".metadata")
            fsync_dir(tmp)
            _publish(folder, tmp, {"files": record}, keep)
        except OSError as e:
            errors.append(f"checkpoint {folder / NEWEST} not saved: {brief(e)}")
    box = [errors[0] if errors else None]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return {"sha256": sha.hexdigest(), "bytes": path.stat().st_size}


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
            state = None if reason else _load(path)
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


def _load(path: Path) -> Any:
    """A file's state; a sharded checkpoint's `rest`, naming its folder as `sharded` for the
    trainer, which reads the shards into its own model and optimizer (`load_sharded`)."""
    if path.is_dir():
        return {**torch.load(path / REST, map_location="cpu", weights_only=False),
                "sharded": path}
    return torch.load(path, map_location="cpu", weights_only=False)


def load_sharded(path: Path, templates: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a sharded checkpoint into `templates` (flat, as saved): a DTensor
    template takes its rows at this world size, a plain one the whole tensor. Without a
    process group (one process) every tensor is read whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dcp.load(templates, storage_reader=dcp.FileSystemReader(path),
             no_dist=not dist.is_initialized())
    return templates


def _verify(path: Path) -> str | None:
    """Why the file (or a sharded checkpoint's file) is not the one written (None: it is, or
    it has no record to check)."""
    record = read_json(record_of(path)) or {}
    if "files" in record:
        return next(filter(None, (_differs(path / name, want, name)
                                  for name, want in record["files"].items())), None)
    if "sha256" not in record:
        return None
    return _differs(path, record, "")


def _differs(path: Path, want: dict[str, Any], name: str) -> str | None:
    where = f"{name}: " if name else ""
    if not path.is_file():
        return f"{where}missing"
    size = path.stat().st_size
    if size != want.get("bytes"):
        return f"{where}{size} bytes where {want.get('bytes')} were written"
    if digest(path)["sha256"] != want.get("sha256"):
        return f"{where}its sha256 is not the one written"
    return None


def set_aside(path: Path) -> Path:
    """Move a checkpoint that failed to load out of the rotation, kept for a look."""
    moved = path.with_name(path.name + ".corrupt")
    record_of(path).unlink(missing_ok=True)
    os.replace(path, moved)
    return moved
