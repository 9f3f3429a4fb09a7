"""A trial's final model in Hugging Face format, written whole or not at all.

    model/          config.json, *.safetensors, the tokenizer: what `from_pretrained` loads
    model.json      {"files": {name: {"sha256", "bytes"}}, "bytes", "step"}, written last

The folder is written under a temporary name, every file fsynced, each saved tensor read back
and compared with the one in memory, and only then renamed into place and its record written.
A trial's training state is removed only after that (`keep_final: weights`), so a kill or a
full disk at any instant leaves either the checkpoint or a verified model, never neither. A
sweep's `keep_models` may drop it once the sweep's run ends (harness/sweep/run/keep.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from harness.errors import brief
from harness.trials.checksums import CheckpointError, digest
from harness.trials.files import fsync_dir, read_json, write_json

Save = Callable[[Path], None]  # writes the model and tokenizer into a folder


def record_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".json")


def write(folder: Path, save: Save, tensors: Mapping[str, torch.Tensor], step: int,
          record: bool = True) -> int:
    """`save` into a temporary folder beside `folder`, fsynced and verified against `tensors`
    (the state dict saved, or a stream_export.Lazy reading each from the checkpoint), then
    renamed into place with its record (unless not `record`: an export elsewhere); returns
    its bytes.
    CheckpointError (one line) when it cannot be written: nothing in place is touched then."""
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    try:
        for stale in folder.parent.glob(f".{folder.name}.tmp*"):  # a writer killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        save(tmp)
        _readable(tmp)
        files = {p.name: _fsynced(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        fsync_dir(tmp)
        _verify_tensors(tmp, tensors)
        record_of(folder).unlink(missing_ok=True)  # a record describes the folder beside it
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)
        total = sum(f["bytes"] for f in files.values())
        if record:
            write_json(record_of(folder), {"files": files, "bytes": total, "step": step})
        return total
    except Exception as e:  # OSError, and what torch and safetensors wrap it in (a full disk)
        raise CheckpointError(f"final model {folder} not written: {brief(e)}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _readable(folder: Path) -> None:
    """Every file with the mode a new file gets (0666 less the umask): a library that writes
    through a temporary file leaves it 0600, unreadable to the group that shares the runs."""
    mask = os.umask(0o022)  # read, then restored: Python has no umask getter
    os.umask(mask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def _fsynced(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return digest(path)


def _verify_tensors(folder: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor in the folder's safetensors files equals the one saved, read one at a time
    (a 7B model is not held twice), and every saved one is there (tied weights are saved
    once: either name counts)."""
    from safetensors import safe_open

    found: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if name not in tensors or not torch.equal(f.get_tensor(name),
                                                          tensors[name].cpu()):
                    raise ValueError(f"{name} does not read back as written")
                found.add(name)
    same = getattr(tensors, "same", lambda n: tensors[n].data_ptr())  # tied: one storage
    saved = {same(n) for n in found}
    missing = {n for n in tensors if n not in found and same(n) not in saved}
    if missing:
        raise ValueError(f"{len(missing)} tensors not saved, e.g. {sorted(missing)[0]}")


def verified(folder: Path) -> int | None:
    """The final model's bytes when its record is there and every file has the size the
    record gives (None: no whole model). Sizes, not hashes: `write` hashed and compared every
    tensor, and this runs each time a finished trial is asked to run again."""
    record = read_json(record_of(folder))
    if not record or not folder.is_dir():
        return None
    for name, want in record.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != want.get("bytes"):
            return None
    return record.get("bytes")


def present(folder: Path) -> bool:
    """Any of the final model on disk: its folder or its record (whole or not)."""
    return folder.exists() or record_of(folder).exists()


def drop(folder: Path) -> int:
    """The final model removed (a sweep's `keep_models`), its record first, so a kill midway
    leaves no record of a model that is not whole; the bytes freed. Another worker of the
    same sweep may be dropping it at the same time: a file or folder gone midway counts as freed
    there (os.walk passes over a folder it cannot list; Path.rglob raised)."""
    freed = sum(_size(Path(root) / f) for root, _, files in os.walk(folder) for f in files)
    record_of(folder).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    return freed


def _size(path: Path) -> int:
    """A file's bytes; 0 for one removed since it was listed."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def remove_state(checkpoints: Path) -> None:
    """The training state and older checkpoints of a finished trial, once its final model is
    in place (or not kept): the folder goes."""
    shutil.rmtree(checkpoints, ignore_errors=True)


def copy(folder: Path, out: Path) -> None:
    """A verified final model copied to `out` (`harness export` of a finished trial), each
    file with the mode a new file gets, not its source's."""
    shutil.copytree(folder, out, dirs_exist_ok=True, copy_function=shutil.copyfile)
