"""Whether a run folder can be made where it was asked for: checked before any trial starts,
so a path under a file or on a disk this process cannot write is one line naming the cause,
not a traceback from the first write (or a trial that fails after its start)."""

from __future__ import annotations

import os
from pathlib import Path

from harness.errors import UserError


def check_writable(out: Path) -> None:
    """UserError (one line) when `out` cannot be a folder this process writes in: a file is
    at it or above it, or the nearest folder of it that exists is on a read-only file
    system or not writable by this user."""
    path = Path(os.path.abspath(out.expanduser()))
    nearest = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not nearest.is_dir():
        raise UserError(f"--out {out}: {nearest} is a file, not a folder; give a path whose "
                        "every part above the run folder is a folder")
    if os.access(nearest, os.W_OK | os.X_OK):
        return
    if os.statvfs(nearest).f_flag & os.ST_RDONLY:
        cause = f"{nearest} is on a read-only file system"
    else:
        cause = f"this user (uid {os.geteuid()}) may not write in {nearest}"
    raise UserError(f"--out {out}: cannot write the run folder there ({cause}); give --out "
                    "on a writable disk")
