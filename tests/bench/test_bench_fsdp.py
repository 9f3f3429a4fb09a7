"""`harness bench fsdp` without starting processes: what it runs, its table, and its bad input
(tests/bench/test_bench.py runs it)."""

from __future__ import annotations

import pytest

from harness.bench.fsdp import fsdp_table, layouts
from harness.cli import main


def test_one_process_runs_once_and_each_strategy_at_each_count():
    assert layouts([1, 2, 4], ["ddp", "hsdp"]) == [
        ("single", 1), ("ddp", 2), ("hsdp", 2), ("ddp", 4), ("hsdp", 4)]
    assert layouts([4], ["fsdp"]) == [("fsdp", 4)]


def record(parallel: str, procs: int, step_s: float, shard_group: int, sent: float) -> dict:
    return {"name": f"fsdp/{parallel}-{procs}", "parallel": parallel, "procs": procs,
            "shard_group": shard_group, "value": step_s, "per_round": [step_s],
            "tokens_per_s": 256 * procs / step_s, "peak_bytes": [2e7, 2.1e7][:procs],
            "sent_bytes": [sent] * procs, "param_bytes": [4.6e6] * procs,
            "model": "llama_micro"}


def test_the_table_names_hsdps_shape_and_each_step_against_ddps():
    text = fsdp_table([record("ddp", 4, 0.5, 1, 4.6e6), record("fsdp", 4, 1.0, 4, 5.2e6),
                       record("hsdp", 4, 0.75, 2, 6.9e6)])
    rows = {line.split()[0]: line for line in text.splitlines()[2:5]}
    assert rows["hsdp"].split()[1] == "2x2"  # 2 groups of 2
    assert rows["fsdp"].split()[-1] == "2.00" and rows["hsdp"].split()[-1] == "1.50"
    assert "20.0 MB to 21.0 MB" in rows["ddp"] and "6.9 MB" in rows["hsdp"]


def test_too_few_steps_is_one_line(capfd):
    assert main(["bench", "fsdp", "--model", "llama_micro", "--steps", "5"]) == 2
    err = capfd.readouterr().err
    assert "--steps 5: bench fsdp times steps 5 on" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--procs", "2,2"], "expected process counts of at least 1"),
    (["--parallel", "ddp,zero"], "expected strategies among ddp, fsdp, hsdp"),
])
def test_bad_flags_are_one_line(capfd, argv, said):
    with pytest.raises(SystemExit) as e:
        main(["bench", "fsdp", *argv])
    assert e.value.code == 2 and said in capfd.readouterr().err
