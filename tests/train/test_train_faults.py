"""Faults a real run meets, each ending as a status with its reason: a torn checkpoint (the one
before is used, or the trial ends `failed`, never a stale `ok`), a full disk while
checkpointing (`failed`, the previous checkpoint whole), a NaN or Inf loss (`nan` at its step),
a host allocation that fails (`oom`).
"""

from __future__ import annotations

import itertools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import micro_run, write_yaml

from harness.methods.resolve import load_run
from harness.train import NonFinite, Trainer, train
from harness.trials import Records, read_json, read_jsonl


def cli_train(config: dict, out: Path, preexec: Callable[[], None] | None = None,
              ) -> subprocess.CompletedProcess:
    """`harness train` in a child process, as a user (or a launcher) runs it."""
    path = write_yaml(out.parent / f"{out.name}.yaml", config)
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "train", str(path), "--out", str(out)],
        capture_output=True, text=True, timeout=600, preexec_fn=preexec,
    )  # fmt: skip


def lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"}


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def drop_final_model(trial: Path) -> None:
    shutil.rmtree(trial / "model")
    (trial / "model.json").unlink()


def test_resume_skips_a_torn_checkpoint_for_the_one_before(tmp_path):
    config = micro_run(steps=6, checkpoint_every=2, keep_final="full")  # the folder read below
    out, ckpt = tmp_path / "t", tmp_path / "t" / "checkpoint"
    assert train(load_run(config), out, should_stop=lambda s: s == 4)["status"] == "interrupted"
    before = losses(out)
    truncate(ckpt / "state.pt")  # the step-4 checkpoint; state-1.pt is step 2's
    done = cli_train(config, out)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    [warning] = lines(done.stderr, "warning: checkpoint")
    assert warning.startswith(f"warning: checkpoint {ckpt / 'state.pt'} does not load (")
    assert warning.endswith(f"moved to state.pt.corrupt, resuming from {ckpt / 'state-1.pt'}")
    assert f"resumed from {ckpt / 'state-1.pt'} at step 2" in done.stdout
    summary = read_json(out / "summary.json")
    assert (summary["status"], summary["step"]) == ("ok", 6)
    after = losses(out)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    assert [after[s] for s in (1, 2, 3, 4)] == [before[s] for s in (1, 2, 3, 4)]  # exact resume
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "state-2.pt", "state-2.pt.json", "state.pt", "state.pt.corrupt", "state.pt.json"]


def test_a_finished_trial_with_torn_checkpoints_trains_again_or_ends_failed(tmp_path):
    """Its final model gone (deleted, or never written) and its last checkpoint torn: it
    trains again from the one before and ends `ok`; none left that loads: `failed` with a
    one-line reason, where it used to keep its stale `ok`."""
    config = micro_run(steps=2, checkpoint_every=1, keep_final="full")
    out, ckpt = tmp_path / "t", tmp_path / "t" / "checkpoint"
    assert train(load_run(config), out)["status"] == "ok"
    drop_final_model(out)
    truncate(ckpt / "state.pt")
    again = cli_train(config, out)
    assert again.returncode == 0 and f"resumed from {ckpt / 'state-1.pt'} at step 1" in again.stdout
    assert len(lines(again.stderr, "warning: checkpoint")) == 1
    assert read_json(out / "summary.json")["status"] == "ok"
    drop_final_model(out)
    for path in ckpt.glob("state*.pt"):
        truncate(path)
    failed = cli_train(config, out)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    [error] = lines(failed.stderr, "error:")
    assert error.startswith(f"error: no checkpoint in {ckpt} loads (state.pt: ")
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and summary["error"] == error.removeprefix("error: ")


def fill(disk: Path, leave: int) -> Path:
    """Take all but `leave` bytes of the filesystem."""
    stat = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize - leave)
    return filler


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


@pytest.mark.parametrize("fault", ["full tmpfs", "file size limit"])
def test_a_full_disk_while_checkpointing_fails_the_trial_and_keeps_the_previous(
        tmp_path, fault, request):
    """Real write failures: a tmpfs filled to 2 MiB short of full (ENOSPC), or the trial
    process's RLIMIT_FSIZE at 1 MiB (EFBIG); metrics and summary lines still fit, the
    checkpoint (about 14 MB) does not."""
    root = request.getfixturevalue("small_disk") if fault == "full tmpfs" else tmp_path
    config = micro_run(steps=4, checkpoint_every=0)
    out, ckpt = root / "t", root / "t" / "checkpoint"
    assert train(load_run(config), out, should_stop=lambda s: s == 2)["status"] == "interrupted"
    before = (ckpt / "state.pt").read_bytes()
    filler = fill(root, 2 << 20) if fault == "full tmpfs" else None
    done = cli_train(config, out, None if filler else limit_file_size)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [error] = lines(done.stderr, "error:")
    reason = "[Errno 28] No space left on device" if filler else "[Errno 27] File too large"
    assert error == f"error: checkpoint {ckpt / 'state.pt'} not saved: {reason}"
    summary = read_json(out / "summary.json")
    assert (summary["status"], summary["step"]) == ("failed", 4)
    assert summary["error"] == error.removeprefix("error: ")
    assert sorted(p.name for p in ckpt.iterdir()) == ["state.pt", "state.pt.json"]
    assert (ckpt / "state.pt").read_bytes() == before
    if filler:
        filler.unlink()
    resumed = train(load_run(config), out)  # room again: it carries on from step 2
    assert (resumed["status"], resumed["step"]) == ("ok", 4)


def test_nan_is_recorded_at_the_step_it_happened_not_at_the_next_log_line(tmp_path):
    every = train(load_run(micro_run(lr=1e30, log_every=1)), tmp_path / "every")
    sparse = train(load_run(micro_run(lr=1e30, log_every=4)), tmp_path / "sparse")
    assert every["status"] == sparse["status"] == "nan"
    assert sparse["nan_step"] == every["nan_step"] == every["step"] < sparse["step"] == 4
    assert sparse["error"] == every["error"]
    assert sparse["error"].endswith(f" at step {every['nan_step']}")


def test_a_host_allocation_that_fails_ends_the_trial_oom(tmp_path, monkeypatch):
    """torch's CPU allocator raises a RuntimeError, not MemoryError, when the host (or a
    ulimit) has no room: `oom` all the same, with its one line."""
    import torch

    monkeypatch.setattr(Trainer, "train_step",
                        lambda self: torch.empty(1 << 62, dtype=torch.uint8))  # 4 EiB
    summary = train(load_run(micro_run(steps=2)), tmp_path / "t")
    assert summary["status"] == "oom" and "can't allocate memory" in summary["error"]


def test_an_inf_loss_ends_the_loop_at_its_step(tmp_path):
    run = load_run(micro_run(steps=6, log_every=5))
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    real, calls, micro = trainer.loss, itertools.count(1), trainer.steps.accumulation
    trainer.loss = lambda net, batch: real(net, batch) * (
        math.inf if next(calls) > 2 * micro else 1.0)  # from step 3's first micro-batch
    with pytest.raises(NonFinite, match=r"^loss is inf at step 3$") as caught:
        trainer.fit()
    trainer.close()
    assert caught.value.step == 3 and trainer.step == 5  # found at step 5's log line


def test_a_stop_signal_while_the_trial_wraps_up_does_not_lose_its_summary(tmp_path,
                                                                          monkeypatch):
    """torchrun SIGTERMs the other ranks as soon as one ends, and an interrupted rank ends
    first (non-zero) while rank 0 may still be closing: that SIGTERM, here sent from inside
    `Trainer.close`, is caught by the trial's own handler (the caller's sees nothing) and the
    summary on disk says `interrupted`; afterwards the caller's handler is back."""
    reached: list[int] = []
    close = Trainer.close

    def close_then_signal(self: Trainer) -> None:
        close(self)
        os.kill(os.getpid(), signal.SIGTERM)

    def record(signum: int, frame: object) -> None:
        reached.append(signum)

    monkeypatch.setattr(Trainer, "close", close_then_signal)
    before = signal.signal(signal.SIGTERM, record)
    try:
        summary = train(load_run(micro_run(steps=4)), tmp_path / "t",
                        should_stop=lambda s: s == 2)
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert reached == [] and after is record
    assert summary["status"] == "interrupted"
    assert read_json(tmp_path / "t" / "summary.json")["status"] == "interrupted"
