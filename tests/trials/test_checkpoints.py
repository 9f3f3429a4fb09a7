"""Checkpoints that survive faults: the newest `keep` kept, each checksummed; a torn, altered or
unreadable one skipped for the one before; a full disk leaves the previous one whole."""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import free_port
from ranks import Ranks

from harness.errors import UserError
from harness.trials import CheckpointError, read_json
from harness.trials.checkpoints import files, load_newest, record_of, save, set_aside


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def saved(folder, *steps: int, keep: int = 2) -> None:
    for step in steps:
        save(folder, {"step": step, "w": torch.full((256,), float(step))}, keep)


def test_keeps_the_newest_each_with_its_size_and_sha256(tmp_path):
    saved(tmp_path, 1, 2, 3, 4)
    assert files(tmp_path) == [tmp_path / "state.pt", tmp_path / "state-3.pt"]
    assert names(tmp_path) == ["state-3.pt", "state-3.pt.json", "state.pt", "state.pt.json"]
    for path in files(tmp_path):
        record = read_json(record_of(path))
        assert record == {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                          "bytes": path.stat().st_size}
    found = load_newest(tmp_path)
    assert found.path == tmp_path / "state.pt" and found.state["step"] == 4 and not found.skipped
    assert torch.load(tmp_path / "state-3.pt", weights_only=False)["step"] == 3


def test_keep_one_leaves_a_single_checkpoint(tmp_path):
    saved(tmp_path, 1, 2, 3, keep=1)
    assert names(tmp_path) == ["state.pt", "state.pt.json"]
    assert load_newest(tmp_path).state["step"] == 3


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_without_record(path) -> None:
    record_of(path).unlink()
    truncate(path)


@pytest.mark.parametrize("fault, reason", [
    (truncate, "bytes where"),
    (flip_a_byte, "sha256 is not the one written"),
    (truncate_without_record, "PytorchStreamReader"),  # torch's own reason, first line only
])  # fmt: skip
def test_a_damaged_newest_is_skipped_for_the_previous(tmp_path, fault, reason):
    saved(tmp_path, 1, 2)
    fault(tmp_path / "state.pt")
    found = load_newest(tmp_path)
    assert found.path == tmp_path / "state-1.pt" and found.state["step"] == 1
    [(path, why)] = found.skipped
    assert path == tmp_path / "state.pt" and reason in why and "\n" not in why


def test_a_checkpoint_without_its_record_still_loads(tmp_path):
    """Written before records existed, or killed between the rename and the record."""
    saved(tmp_path, 1)
    record_of(tmp_path / "state.pt").unlink()
    assert load_newest(tmp_path).state["step"] == 1


def test_none_loading_is_one_line_naming_every_file(tmp_path):
    saved(tmp_path, 1, 2)
    truncate(tmp_path / "state.pt")
    flip_a_byte(tmp_path / "state-1.pt")
    with pytest.raises(CheckpointError) as caught:
        load_newest(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "state.pt: " in message and "state-1.pt: " in message
    assert "delete that folder" in message and str(tmp_path) in message
    assert load_newest(tmp_path / "none") is None  # no checkpoint at all: a fresh start


def test_a_set_aside_checkpoint_leaves_the_rotation(tmp_path):
    """Saves after a fallback keep the good one, not the damaged one it skipped."""
    saved(tmp_path, 1, 2)
    truncate(tmp_path / "state.pt")
    found = load_newest(tmp_path)
    assert set_aside(found.skipped[0][0]) == tmp_path / "state.pt.corrupt"
    saved(tmp_path, 3)
    assert [load_newest(tmp_path).state["step"], torch.load(files(tmp_path)[1])["step"]] == [3, 1]
    assert (tmp_path / "state.pt.corrupt").exists()


SAVE_BIG = """
import sys, torch
from pathlib import Path
from harness.trials import CheckpointError
from harness.trials.checkpoints import save
try:
    save(Path(sys.argv[1]), {"step": 2, "w": torch.zeros(1 << 20)}, 2)
except CheckpointError as e:
    print(e)
"""


def test_a_save_the_disk_cannot_hold_leaves_the_previous_whole(tmp_path):
    """A real write failure: the child's file size limit (RLIMIT_FSIZE) makes the kernel refuse
    the write past 1 MiB (EFBIG, as ENOSPC on a full disk; tests/train/test_train_faults.py fills a
    real tmpfs)."""
    saved(tmp_path, 1)
    before = (tmp_path / "state.pt").read_bytes()
    limit = 1 << 20
    done = subprocess.run(
        [sys.executable, "-c", SAVE_BIG, str(tmp_path)], capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"checkpoint {tmp_path / 'state.pt'} not saved: "
                                   "[Errno 27] File too large")
    assert names(tmp_path) == ["state.pt", "state.pt.json"]  # no temp file left behind
    assert (tmp_path / "state.pt").read_bytes() == before
    assert load_newest(tmp_path).state["step"] == 1


KEEP_SAVING = """
import sys, torch
from pathlib import Path
from harness.trials.checkpoints import save
for step in range(1, 1000):
    save(Path(sys.argv[1]), {"step": step, "w": torch.rand(1 << 24)}, 2)  # 64 MiB each
"""


def test_a_kill_mid_save_leaves_the_previous_whole(tmp_path):
    """SIGKILL while a 64 MiB save is being written: the checkpoints before it load, verified,
    and the next save clears the temp file the killed writer left."""
    child = subprocess.Popen([sys.executable, "-c", KEEP_SAVING, str(tmp_path)])
    deadline = time.monotonic() + 300
    while not (len(files(tmp_path)) == 2 and list(tmp_path.glob(".state.pt.tmp*"))):
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert list(tmp_path.glob(".state.pt.tmp*"))  # killed mid-write
    found = load_newest(tmp_path)
    assert not found.skipped and found.state["step"] >= 2
    saved(tmp_path, found.state["step"] + 1)
    assert not list(tmp_path.glob(".state.pt.tmp*"))


def test_a_sharded_checkpoint_is_verified_by_the_ranges_each_rank_reads(tmp_path):
    """Two ranks (tests/trials/dcp_ranks.py) save a sharded model and AdamW with
    torch.distributed.checkpoint, blocking and then in the background, and read it back at the
    same world size: each rank verifies and opens only its own shard files (a row-sharded
    weight's rows and moments are its own) and rank 0's optimizer file (the steps every rank
    holds alike, written once by the lowest rank), the
    background save is not the newest until published, and a model of another layout is
    refused in one line naming the key and both shapes."""
    done = Ranks([str(tmp_path)], 2, free_port(), "dcp_ranks")
    log, _ = done.communicate(timeout=300)
    assert done.returncode == 0, log
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, s in enumerate(seen):
        assert s["in_flight_newest"] == 1 and s["published_newest"] == 2
        assert s["same_weights"] and s["first_save_differs"]
        assert s["exp_avg_rows"] == [16, 16]  # 32 rows over 2 ranks: this rank's half
        own = {f"{part}/__{rank}_0.distcp" for part in ("model", "optimizer")}
        # and the lowest rank's optimizer file, which holds the steps every rank holds alike
        assert set(s["opened"]) <= own | {"model/.metadata", "optimizer/.metadata",
                                          "optimizer/__0_0.distcp"}
        assert own <= set(s["opened"]) and set(s["verified"]) == set(s["opened"])
        assert s["layout"] == (
            f"{tmp_path / 'checkpoint' / 'state.pt'}: model key 0.weight is shaped (32, 16) in "
            "this checkpoint; this run's model and method hold (40, 16): it is another model's "
            "or method's; use another --out or delete that folder")


def test_a_sharded_checkpoint_of_the_format_before_parts_is_refused_saying_how_to_convert(
        tmp_path):
    """One folder of shards with the skeleton in rest.pt (written before DCP state dicts): one
    line naming it and how to convert it; the folder stays as it was."""
    folder = tmp_path / "state.pt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"metadata")
    (folder / "__0_0.distcp").write_bytes(b"shards")
    torch.save({"tensors": {"model": {}}, "step": 3}, folder / "rest.pt")
    before = names(folder)
    with pytest.raises(UserError) as refused:
        load_newest(tmp_path)
    assert str(refused.value) == (
        f"{folder}: a sharded checkpoint in the format of harness before DCP state dicts (one "
        "folder of shards and a skeleton); convert it by resuming it at one process with the "
        "harness version that wrote it (`harness train` then writes a one-process checkpoint, "
        "which this version resumes at any world size), or delete that folder to start the "
        "trial over")
    assert names(folder) == before and files(tmp_path) == [folder]
