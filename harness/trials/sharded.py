"""A sharded trial's checkpoint (fsdp): a folder written by every rank with
torch.distributed.checkpoint (DCP), published as one file would be (harness/trials/checkpoints.py).

    state.pt/model/         the model's state dict, keyed by parameter name (`.metadata`,
                            `__<rank>_0.distcp`: each rank's shards, one copy of the rest)
    state.pt/optimizer/     the optimizer's, flattened (`state.<name>.<key>`), the same way
    state.pt/rest.pt        rank 0: schedule, data position, counters, every rank's RNG
    state.pt.json           {"files": {path: {"bytes", "sha256"} or {"bytes", "items"}}}

Each rank records the sha256 of every item it wrote (byte range of its own files, from DCP's
metadata), so that a resume reads and verifies only the ranges holding what it loads; the
export reads `model/` alone. A save writes into a temporary folder, fsynced; rank 0 renames it
into place only once every rank has written (in the background with `train.checkpoint_async`:
published at the next save or when the trial ends), so a kill mid-write leaves the previous
checkpoint the newest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.errors import UserError, brief
from harness.trials.checksums import CheckpointError, differs, digest, range_sha, write_state
from harness.trials.files import fsync_dir

REST = "rest.pt"  # in a sharded checkpoint's folder: everything but the sharded tensors
PARTS = ("model", "optimizer")
METADATA = ".metadata"

Publish = Callable[[Path, dict[str, Any]], None]  # (temp folder, its record) → in place


class Corrupt(Exception):
    """A file or byte range whose bytes are not the ones written."""


def dist() -> Any:
    import torch.distributed as d

    return d


def dcp() -> Any:
    import torch.distributed.checkpoint as c

    return c


def writer(path: Path) -> Any:
    return dcp().FileSystemWriter(path, sync_files=True)


def planner() -> Any:
    """DCP's planner, every tensor the ranks hold alike (steps, GaLore's bases) written by the
    lowest rank holding it: a rank reads its own file and at most that one."""
    return dcp().DefaultSavePlanner(dedup_save_to_lowest_rank=True)


@dataclass
class Background:
    """`train.checkpoint_async`: a gloo group and a stager per part (pinned host memory on
    CUDA, reused from save to save) and the save in flight, published before the next."""

    groups: dict[str, Any] = field(default_factory=dict)
    stagers: dict[str, Any] = field(default_factory=dict)
    pending: Callable[[], None] | None = None

    def start(self, name: str, state: dict[str, Any], path: Path) -> Future:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if name not in self.groups:  # its own group: the write's collectives run beside training's
            self.groups[name] = dist().new_group(backend="gloo")
            cuda = torch.cuda.is_available()
            self.stagers[name] = DefaultStager(StagingOptions(cuda, False, False, cuda))
        return dcp().async_save(state, storage_writer=writer(path), planner=planner(),
                                process_group=self.groups[name], async_stager=self.stagers[name])

    def wait(self) -> None:
        """The save in flight published (or its one-line CheckpointError raised)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for stager in self.stagers.values():
                stager.close()
            self.stagers.clear()


def save(tmp: Path, parts: dict[str, dict[str, Any]], rest: dict[str, Any], publish: Publish,
         background: Background | None) -> None:
    """Every rank writes its shards of each part into `tmp`, and rank 0 `rest`; once all have
    written, `publish` (rank 0) puts the folder in place. With `background`, the writes run
    beside training and the publishing happens at `background.wait()`."""
    if background is None:
        error = None
        try:
            for name, state in parts.items():
                dcp().save(state, storage_writer=writer(tmp / name), planner=planner())
        except (Exception, dcp().CheckpointException) as e:  # DCP's: every rank alike
            error = brief(e)
        _finish(tmp, rest, publish, error)
        return
    futures = [background.start(name, state, tmp / name) for name, state in parts.items()]
    rest = copy.deepcopy(rest)  # as it is now: training goes on before it is written

    def finish() -> None:
        error = None
        for future in futures:
            try:
                future.result()
            except (Exception, dcp().CheckpointException) as e:
                error = error or brief(e)
        _finish(tmp, rest, publish, error)

    background.pending = finish


def _finish(tmp: Path, rest: dict[str, Any], publish: Publish, error: str | None) -> None:
    """Each rank hashes the items it wrote; rank 0 writes `rest`, and publishes unless any
    rank failed; every rank raises the first error (CheckpointError, one line)."""
    d, mine = dist(), {}
    if error is None:
        try:
            mine = own_items(tmp, d.get_rank())
        except OSError as e:
            error = brief(e)
    every: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(every, (error, mine))
    errors = [e for e, _ in every if e]
    if d.get_rank() == 0 and not errors:
        try:
            record = {k: v for _, items in every for k, v in items.items()}
            record[REST] = write_state(tmp / REST, rest)
            for name in PARTS:
                if (tmp / name / METADATA).exists():
                    record[f"{name}/{METADATA}"] = digest(tmp / name / METADATA)
                    fsync_dir(tmp / name)
            fsync_dir(tmp)
            publish(tmp, {"files": record})
        except OSError as e:
            errors.append(brief(e))
    box = [errors[0] if errors else None]
    d.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def own_items(tmp: Path, rank: int) -> dict[str, Any]:
    """The sha256 of each byte range (item) this rank wrote, by file: what a reader of that
    range checks, and the file's size."""
    out: dict[str, Any] = {}
    for name in PARTS:
        if not (tmp / name / METADATA).exists():
            continue
        meta = dcp().FileSystemReader(tmp / name).read_metadata()
        ranges: dict[str, set[tuple[int, int]]] = {}
        for info in meta.storage_data.values():
            if info.relative_path.startswith(f"__{rank}_"):
                ranges.setdefault(info.relative_path, set()).add((info.offset, info.length))
        for rel, spans in ranges.items():
            path = tmp / name / rel
            with open(path, "rb") as f:
                items = {f"{o}+{n}": range_sha(f, o, n) for o, n in sorted(spans)}
            out[f"{name}/{rel}"] = {"bytes": path.stat().st_size, "items": items}
    return out


def verify_whole(path: Path, record: dict[str, Any]) -> str | None:
    """Why `rest.pt`, which every reader needs, is not the one written (each part's files are
    checked as that part is read: `load`)."""
    want = record.get("files", {}).get(REST)
    return differs(path / REST, want, REST) if want else None


def is_old(path: Path) -> bool:
    """A sharded checkpoint in the format before parts (every tensor under one DCP folder,
    nested back by a skeleton in `rest.pt`)."""
    return (path / METADATA).exists() and not (path / "model").is_dir()


def old_format(path: Path) -> UserError:
    return UserError(
        f"{path}: a sharded checkpoint in the format of harness before DCP state dicts (one "
        "folder of shards and a skeleton); convert it by resuming it at one process with the "
        "harness version that wrote it (`harness train` then writes a one-process "
        "checkpoint, which this version resumes at any world size), or delete that folder "
        "to start the trial over")


def reader(path: Path, record: dict[str, Any], opened: set[str] | None = None) -> Any:
    """A DCP reader of one part (`path`) that, before DCP reads anything, checks the size of
    each file and the sha256 of each byte range this rank's plan reads against `record`
    (the checkpoint's, paths relative to its folder): Corrupt where one differs. `opened`
    collects the files it checked (the only ones DCP then opens)."""

    class Verifying(dcp().FileSystemReader):
        def prepare_local_plan(self, plan: Any) -> Any:
            ranges: dict[str, set[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                ranges.setdefault(info.relative_path, set()).add((info.offset, info.length))
            for rel, spans in sorted(ranges.items()):
                _check(path, f"{path.name}/{rel}", spans, record)
                if opened is not None:
                    opened.add(f"{path.name}/{rel}")
            return plan

    return Verifying(path)


def _check(path: Path, key: str, spans: set[tuple[int, int]], record: dict[str, Any]) -> None:
    want = record.get("files", {}).get(key)
    if want is None:
        return  # no record (a kill between the rename and the record): fsynced before it
    file = path.parent / key
    size = file.stat().st_size if file.is_file() else None
    if size != want.get("bytes"):
        raise Corrupt(f"{key}: {size} bytes where {want.get('bytes')} were written")
    with open(file, "rb") as f:
        for offset, length in sorted(spans):
            if range_sha(f, offset, length) != want["items"].get(f"{offset}+{length}"):
                raise Corrupt(f"{key}: its sha256 is not the one written")


def load(path: Path, name: str, state: dict[str, Any], record: dict[str, Any],
         opened: set[str] | None = None) -> None:
    """Part `name` of the checkpoint at `path` into `state` (tensors as this rank holds them:
    a DTensor its rows, a plain tensor whole; in place), each byte range verified as read.
    UserError (one line) where the checkpoint holds another layout; Corrupt where a range is
    not the one written (on every rank: DCP gathers the failures)."""
    folder = path / name
    want = record.get("files", {}).get(f"{name}/{METADATA}")
    why = differs(folder / METADATA, want, f"{name}/{METADATA}") if want else None
    if why:
        raise Corrupt(why)
    if opened is not None:
        opened.add(f"{name}/{METADATA}")
    meta = dcp().FileSystemReader(folder).read_metadata()
    same_layout(path, name, state, meta.state_dict_metadata)
    try:
        dcp().load(state, storage_reader=reader(folder, record, opened),
                   no_dist=not dist().is_initialized())
    except dcp().CheckpointException as e:
        failures = [f for f, _ in e.failures.values()]
        raise next((f for f in failures if isinstance(f, Corrupt)), failures[0]) from None


def same_layout(path: Path, name: str, state: dict[str, Any], saved: dict[str, Any]) -> None:
    """UserError naming the first key this run needs that the checkpoint lacks or holds in
    another shape, or the first state it holds that this run has no place for (another model
    or method): nothing is read then."""
    extra = next((k for k in saved if k not in state and k.startswith("state.")), None)
    if extra is not None:
        raise UserError(f"{path}: {name} key {extra} is in this checkpoint but not in this "
                        "run's model and method (they hold e.g. "
                        f"{next(iter(state), 'none')}): it is another model's or method's; "
                        "use another --out or delete that folder")
    for key, value in state.items():
        have = saved.get(key)
        if have is None:
            raise UserError(f"{path}: {name} key {key} is not in this checkpoint (this run's "
                            f"model and method need it; the checkpoint holds {len(saved)} keys, "
                            f"e.g. {next(iter(saved), 'none')}): it is another model's or "
                            "method's; use another --out or delete that folder")
        shape = getattr(have, "size", None)
        if isinstance(value, torch.Tensor) and shape is not None and tuple(shape) != \
                tuple(value.shape):
            raise UserError(f"{path}: {name} key {key} is shaped {tuple(shape)} in this "
                            f"checkpoint; this run's model and method hold "
                            f"{tuple(value.shape)}: it is another model's or method's; use "
                            "another --out or delete that folder")
