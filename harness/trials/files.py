"""Reading and writing the run folder's files: atomic writes, tolerant reads.

A trial may be killed at any instant and `harness status` reads folders while trials write
them, so a write is all-or-nothing (temp file, fsync, rename, fsync of the folder) and a read
takes a missing or half-written file as absent rather than raising. A record that a reader
must not take for absent (a trial's summary) is read with `read_json_record`: a file that is
there but cannot be read raises `UnreadableFile`, naming it and why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml


@contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A binary file that becomes `path` only once the body has written all of it: written to
    a temp file beside it, flushed and fsynced, renamed over `path`, then the folder fsynced so
    the rename itself survives a power loss. A crash before the rename leaves `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; a filesystem that cannot fsync a folder is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write-then-rename, so a crash never leaves a half-written file behind."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """None for a file that is missing, half-written or not a JSON object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


class UnreadableFile(Exception):
    """A run-folder file that is there but cannot be read: damaged, not missing."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def read_json_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None only when there is no file. Written atomically, a file
    that is there is whole, so one that does not parse is damaged: UnreadableFile says why."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnreadableFile(path, e.strerror or str(e)) from None
    if not raw.strip():
        raise UnreadableFile(path, f"empty ({len(raw)} bytes)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(path, f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(path, f"not JSON ({e.msg}: line {e.lineno} column {e.colno}, "
                                   f"{len(raw)} bytes)") from None
    if not isinstance(data, dict):
        raise UnreadableFile(path, f"not a JSON object: {json.dumps(data)[:40]}")
    return data


def write_yaml(path: Path, obj: Any) -> None:
    atomic_write(path, yaml.safe_dump(obj, sort_keys=False))


# libyaml's safe loader where PyYAML was built with it: the same documents, ~10x faster (a
# 2,000-trial report read its configs in 12 of its 58 s with the pure-Python one)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml_or_empty(path: Path) -> dict[str, Any]:
    """{} for a file that is missing, unparsable or not a mapping: a trial not yet written."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except (FileNotFoundError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole record; a line cut short by a crash or a concurrent write is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return [r for r in (json_line(line) for line in text.splitlines()) if isinstance(r, dict)]


def read_jsonl_tail(path: Path, nbytes: int = 16384) -> list[dict[str, Any]]:
    """The whole records in the last `nbytes` of the file (its first, likely cut, line dropped
    when the read starts mid-file): the latest progress of a long log without reading all of
    it; [] if unreadable."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - nbytes)
            f.seek(start)
            tail = f.read().decode("utf-8", "replace").splitlines()[1 if start else 0:]
    except OSError:
        return []
    return [r for r in (json_line(line) for line in tail) if isinstance(r, dict)]


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One record per line, fsynced: a line logged before a checkpoint survives a power loss
    with it. A reader skips a line this write has not finished."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def json_line(line: str) -> Any:
    """The value on one line, or None where the line is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
