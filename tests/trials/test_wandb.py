"""wandb offline: one run per trial, grouped by sweep, config at start, summary at the end."""

from __future__ import annotations

from conftest import harness_here, micro_run, write_yaml


def test_each_trial_is_one_offline_run_grouped_by_its_sweep(tmp_path):
    run = micro_run(steps=2)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data.update(name="wbsweep", methods={"full": {}}, wandb={"enabled": True, "project": "proj"},
                search={"space": {"train.lr": [1e-3, 2e-3]}})
    out = tmp_path / "runs"
    done = harness_here("sweep", str(write_yaml(tmp_path / "s.yaml", data)), "--out", str(out))
    assert done.returncode == 0, done.stderr
    trial_dirs = sorted((out / "trials").iterdir())
    assert len(trial_dirs) == 2
    for trial_dir in trial_dirs:
        (offline,) = (trial_dir / "wandb").glob("offline-run-*")
        # The offline log is protobuf records: the group, run id, config and summary are in it
        # as plain strings, which is what `wandb sync` uploads.
        blob = next(offline.glob("*.wandb")).read_bytes()
        for text in ("wbsweep", f"wbsweep-{trial_dir.name}", "total_batch_size", "eval_ppl",
                     "optimizer_state_bytes", "proj"):
            assert text.encode() in blob, (trial_dir.name, text)
