"""A summary.json that is there but cannot be read is `unreadable`, naming the file and why:
never taken for a trial not yet run, never written back, moved aside before a new one."""

from __future__ import annotations

import pytest
from conftest import micro_run

from harness.methods.resolve import load_run
from harness.trials import Records, Status, TrialDir, read_json

# (what summary.json holds, why it cannot be read); reasons worked out from the bytes by hand
DAMAGED = [
    (b'{"trial": "x", "status": "ok", "eval_',  # cut short: 37 bytes, the string opens at 32
     "not JSON (Unterminated string starting at: line 1 column 32, 37 bytes)"),
    (b"", "empty (0 bytes)"),
    (b" \n\n", "empty (3 bytes)"),
    (b'{"status": "\xff"}', "not UTF-8 text (byte 12)"),
    (b"[1, 2]", "not a JSON object: [1, 2]"),
    (b"null", "not a JSON object: null"),
    (b'{"trial": "x", "eval_ppl": 25.0}', "no status"),
    (b'{"trial": "x", "status": 3}', "status 3 is not a string"),
]


@pytest.mark.parametrize(("content", "reason"), DAMAGED)
def test_a_damaged_summary_is_unreadable_not_pending(tmp_path, content, reason):
    trial = TrialDir(tmp_path / "t1")
    trial.path.mkdir()
    trial.summary.write_bytes(content)
    summary = trial.read_summary()
    assert summary.status == Status.UNREADABLE == "unreadable"
    assert summary.error == f"{trial.summary}: {reason}"
    assert summary.to_dict() == {"trial": "t1", "status": "unreadable",
                                 "error": f"{trial.summary}: {reason}"}


def test_an_unreadable_summary_is_never_written_back(tmp_path):
    """A requeue cannot count on a record it cannot read (its file stays byte for byte); a
    crash recorded by the launcher moves the damaged file aside and records the crash."""
    trial = TrialDir(tmp_path / "t1")
    trial.path.mkdir()
    damaged = b'{"trial": "t1", "requeues": 0}'  # no status
    trial.summary.write_bytes(damaged)
    trial.count_requeue()
    assert trial.summary.read_bytes() == damaged
    trial.record_crash(1)
    assert read_json(trial.summary) == {"trial": "t1", "status": "failed",
                                        "error": "trial process ended with exit code 1"}
    assert trial.corrupt_summary.read_bytes() == damaged
    assert trial.corrupt_summary.name == "summary.json.corrupt"


def test_a_run_moves_an_unreadable_summary_aside_with_one_line(tmp_path, capsys):
    """What `harness train` (and a sweep's `--retry-failed`) does with a trial whose summary
    cannot be read: the run starts as if it had none, and its first summary write moves the
    damaged file to summary.json.corrupt, saying so in one line on stderr."""
    out = tmp_path / "t1"
    out.mkdir()
    damaged = b'{"trial": "t1", "status": "ok", "eval_ppl": 2'
    (out / "summary.json").write_bytes(damaged)
    rec = Records(out, load_run(micro_run()))
    assert rec.summary() is None
    rec.write_summary({"trial": "t1", "status": "running"})
    rec.write_summary({"trial": "t1", "status": "ok"})
    assert (out / "summary.json.corrupt").read_bytes() == damaged
    assert read_json(out / "summary.json") == {"trial": "t1", "status": "ok"}
    err = capsys.readouterr().err
    assert err == (f"warning: {out / 'summary.json'}: not JSON (Expecting ',' delimiter: line 1 "
                   "column 46, 45 bytes); moved to summary.json.corrupt, this run writes a new "
                   "summary\n")
