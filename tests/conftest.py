"""Shared fixtures: a micro LLaMA on the embedded sample corpus, small enough for CI.

Helpers (imported as `from conftest import ...`): `micro_run` (a run config), `micro_model` (a
small LLaMA preset, seeded), `write_c4_shards` (a local C4-layout corpus), `write_yaml`,
`harness` (the real command line). Fixtures: `micro`, `tiny_model`, `sample_tokenizer`,
`tiny_corpus`, and `finished_run` (a sweep run once per session through the CLI; read-only,
`finished_run_copy` for a test that writes into it).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# Idle OpenMP threads sleep instead of spinning (libgomp reads this as torch loads, here and in
# every child): tests run two at a time on 2 cores, and a trial's spinning threads then burn
# the other test's core. Measured: 4 trials of 2 threads at once, 35 s active, 16 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No test may reach for the hub: fail fast instead of waiting on retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_SILENT"] = "true"

REPO = Path(__file__).resolve().parents[1]
SAMPLE_VOCAB = 8192  # the embedded sample tokenizer's vocabulary (tests/data/test_c4.py checks)


def micro_run(**train: Any) -> dict[str, Any]:
    """A run config that trains in about a second a step on 2 CPU cores."""
    return {
        "name": "test",
        "model": "llama_micro",
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32, "shuffle_buffer": 32},
        "train": {
            "lr": 0.003,
            "steps": 6,
            "batch_size": 2,
            "total_batch_size": 4,
            "warmup_steps": 1,
            "log_every": 1,
            **train,
        },
        "eval": {"every": 3, "tokens": 256},
        "method": {"name": "full"},
    }


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def harness(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real command line, in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ},
        timeout=600,
    )


@pytest.fixture
def micro() -> dict[str, Any]:
    return micro_run()


def micro_model(seed: int | None = 0, preset: str = "llama_micro", vocab: int = SAMPLE_VOCAB,
                seq_len: int = 32, pad_id: int | None = None) -> Any:
    """A freshly initialised LLaMA preset as the trainer builds it (llama_micro: 2 layers,
    hidden 64, 1.15M parameters on the sample vocabulary); `seed` seeds torch first (None:
    the global generator as it stands)."""
    import torch

    from harness.models import build_model

    if seed is not None:
        torch.manual_seed(seed)
    return build_model(preset, vocab, seq_len, pad_id)


@pytest.fixture
def tiny_model() -> Any:
    """llama_micro on the sample vocabulary, seed 0: a new one for each test."""
    return micro_model()


@pytest.fixture(scope="session")
def sample_tokenizer() -> Any:
    """The embedded sample tokenizer (read-only: tokenizing does not change it)."""
    from harness.data.c4 import load_tokenizer

    return load_tokenizer("sample")


def write_c4_shards(root: Path, splits: dict[str, list[str]], shards: int = 1) -> Path:
    """A local corpus in C4's layout: `c4-<split>.<k>-of-<n>.json.gz`, one JSON row a line."""
    root.mkdir(parents=True, exist_ok=True)
    for split, texts in splits.items():
        for k in range(shards):
            path = root / f"c4-{split}.{k:05d}-of-{shards:05d}.json.gz"
            with gzip.open(path, "wt") as f:
                for i, text in enumerate(texts[k::shards]):
                    row = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"u{i}"}
                    f.write(json.dumps(row) + "\n")
    return root


TINY_CORPUS = {"train": [f"train doc {i}" for i in range(6)], "validation": ["valid doc"]}


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    """TINY_CORPUS as local C4 shards: six train documents over 2 shards, one validation."""
    return write_c4_shards(tmp_path / "corpus", TINY_CORPUS, shards=2)


# The finished run: two methods at one LR, 4 steps of llama_micro, evals at steps 2 and 4.
FINISHED_SWEEP: dict[str, Any] = {
    "name": "finished",
    **{k: v for k, v in micro_run(steps=4).items() if k in ("model", "task", "train")},
    "eval": {"every": 2, "tokens": 256},
    "methods": {"full": {}, "adam8bit": {}},
    "search": {"space": {"train.lr": [0.003]}},
}


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs folder as `harness sweep` leaves it (FINISHED_SWEEP, both trials ok), built once
    per session through the real command. Shared: read it, never write into it (use
    `finished_run_copy` for that)."""
    root = tmp_path_factory.mktemp("finished")
    path = write_yaml(root / "finished.yaml", FINISHED_SWEEP)
    done = harness("sweep", str(path), "--out", str(root / "runs"), "--jobs", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return root / "runs"


@pytest.fixture
def finished_run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A private copy of `finished_run`, for a test that writes a report or changes a trial."""
    return Path(shutil.copytree(finished_run, tmp_path / "runs"))


@pytest.fixture(autouse=True)
def one_thread():
    """OpenMP threads spin-wait when 2 cores are oversubscribed (a CI box running other work),
    which turns a 1 s SVD into a minute; one thread keeps test times steady."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_estimate_matches(estimate: Any, summary: dict[str, Any]) -> None:
    """The analytic prediction equals the bytes counted from the trained model's tensors."""
    assert estimate.weight_bytes == summary["param_bytes"]
    assert estimate.grad_bytes == summary["grad_bytes"]
    assert estimate.optimizer_state_bytes == summary["optimizer_state_bytes"]
    assert estimate.extra_bytes == summary["extra_bytes"]


def missing(what: str, how: str) -> None:
    """A test that needs a service or a privilege this machine lacks: skipped with `how` to get
    it on a developer's machine, a failure in CI (CI=true, which .ci/run sets), where it must
    be there."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI ({how})")
    pytest.skip(f"needs {what}: {how}")


def chromium() -> str:
    """Skipped on a developer's machine without it, but never in CI, where .ci/run installs it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        missing("chromium", "`sudo bash scripts/chromium.sh`")
    return path  # type: ignore[return-value]


def headless(browser: str, page: Path, profile: Path, *flags: str) -> str:
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", f"--user-data-dir={profile}", *flags, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout


def require_service(env: str, what: str, start: str) -> str:
    """Tests on a real cluster or database: the service's address from `env`, which `.ci/run`
    sets after starting it."""
    value = os.environ.get(env)
    if not value:
        missing(what, f"`{start}`, then set {env}")
    return value  # type: ignore[return-value]


def train_losses(trial_dir: Path) -> dict[int, float]:
    """Logged training loss by step, for comparing an interrupted run with a clean one."""
    from harness.trials import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(trial_dir / "metrics.jsonl")
            if r["kind"] == "train"}


def wait_for_step(trial_dir: Path, step: int, timeout_s: float = 300) -> None:
    import time

    deadline = time.time() + timeout_s
    while max(train_losses(trial_dir), default=0) < step:
        assert time.time() < deadline, f"{trial_dir} never reached step {step}"
        time.sleep(0.2)


def assert_matches_one_process(trial_dir: Path, run: dict[str, Any], scratch: Path) -> None:
    """A data-parallel trial's losses equal those of `run` trained here in one process."""
    from harness.methods.resolve import load_run
    from harness.train import train
    from harness.trials import read_json

    single = train(load_run(run), scratch)
    ddp, one = train_losses(trial_dir), train_losses(scratch)
    assert ddp.keys() == one.keys()
    assert all(abs(ddp[s] - one[s]) < 1e-5 for s in one)
    assert read_json(trial_dir / "summary.json")["eval_loss"] == pytest.approx(
        single["eval_loss"], rel=1e-5)


def start_sweep(path: Path, out: Path, *sets: str,
                stderr: int = subprocess.PIPE) -> subprocess.Popen:
    """`harness sweep PATH --out OUT --set ...` in a child process, as a user starts it
    (`stderr=subprocess.STDOUT`: one stream, read in order)."""
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(path), "--out", str(out), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(config: Path, out: Path, procs: int = 2) -> subprocess.Popen:
    """`harness train` as a user starts it data-parallel: 2 processes (gloo on CPU), each on one
    thread so that kernels sum in the same order as the 1-process reference."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
           "--master_port", str(free_port()), "-m", "harness.cli", "train", str(config),
           "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_two_processes_train_as_one(data: dict[str, Any], tmp_path: Path) -> None:
    """`data` under torchrun (2 processes) and here in one: both ok, the same logged steps,
    every loss within 1e-5 relative."""
    from harness.methods.resolve import load_run
    from harness.train import train
    from harness.trials import read_json

    proc = torchrun(write_yaml(tmp_path / "run.yaml", data), tmp_path / "two")
    one = train(load_run(data), tmp_path / "one")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert one["status"] == read_json(tmp_path / "two" / "summary.json")["status"] == "ok"
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert a.keys() == b.keys() == set(range(1, data["train"]["steps"] + 1))
    assert [b[s] for s in a] == pytest.approx(list(a.values()), rel=1e-5, abs=0)


def assert_resumes_exactly(run: Any, tmp_path: Path, stop: int = 3) -> None:
    """`run` stopped after step `stop` and resumed ends ok with every logged loss equal to the
    same run never stopped."""
    from harness.train import train

    train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == stop)
    assert (first["status"], first["step"]) == ("interrupted", stop)
    assert train(run, tmp_path / "resumed")["status"] == "ok"
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")


# -- the integration tier ------------------------------------------------------------------------
# Tests that start processes (the CLI in a child, torchrun, a sweep's trials, Slurm jobs,
# Chromium), use a service, or run a sweep's worth of trainings (a sweep, a benchmark, the
# method x modifier grid) carry the `integration` marker, applied here, so that
# `pytest -m "not integration"` is a quick loop for an edit. A grid keeps some cases quick: a
# test module's `QUICK` maps a test's name to the parameter tuples that stay (the matrix's
# diagonal: every method once, every modifier at least once). A test that starts a process
# without the marker fails (`unmarked_processes` below), so these lists cannot fall behind.
INTEGRATION_FILES = {  # every test in these files
    "sweep/test_faults.py", "sweep/test_launchers.py", "sweep/test_postgres.py",
    "sweep/test_run.py", "sweep/test_slurm.py", "sweep/test_study.py", "sweep/test_sweep.py",
    "train/test_ddp.py", "train/test_fsdp.py", "test_distributed.py", "analysis/test_html.py",
    "trials/test_wandb.py",
    "bench/test_bench.py",  # `harness bench`: many trainings (every method, every config)
    "gpu/test_gpu.py",  # the CUDA checks (`pytest -m gpu`): a grid of trainings and a sweep
    "test_optional_imports.py",  # the CLI in a child without wandb and psycopg2
    "cost/test_sharded.py",  # fsdp runs under torchrun
}
INTEGRATION_FIXTURES = {"finished_run", "finished_run_copy"}  # a sweep through the CLI
INTEGRATION_TESTS = {  # test names (parameters left out) in other files
    "test_two_processes_train_as_one", "test_two_processes_layerwise_train_as_one",  # torchrun
    "test_bench_launch_times_each_launcher", "test_bench_loop_json_pipes_into_a_json_reader",
    "test_user_error_from_the_real_command", "test_llama_7b_in_24gb",
    "test_llama_7b_on_8_gpus_of_80gb",
    "test_one_command_pretrains_then_fine_tunes_and_reports",
    "test_resume_skips_a_torn_checkpoint_for_the_one_before",
    "test_a_full_disk_while_checkpointing_fails_the_trial_and_keeps_the_previous",
    "test_a_finished_trial_with_torn_checkpoints_trains_again_or_ends_failed",
    "test_a_save_the_disk_cannot_hold_leaves_the_previous_whole",
    "test_a_kill_mid_save_leaves_the_previous_whole",
    "test_wandb_logs_offline_into_the_run_folder",  # wandb's service process
    "test_compile_trains_the_same_model",  # torch.compile runs the C++ compiler
    "test_an_8bit_kernel_is_loaded_before_the_first_step",  # a fresh process
    # `harness bench gpu`: its smoke run and a part killed at its cap
    "test_smoke_runs_every_part_once_and_a_second_run_goes_on_with_what_is_left",
    "test_a_part_past_its_cap_is_killed_and_says_so",
    "test_a_tests_part_cut_off_at_its_cap_keeps_the_outcomes_it_had",
    "test_parts_and_cap_choose_what_runs_and_how_long",
    "test_the_lease_script_runs_every_part_into_four_folders",
    "test_bench_report_times_the_report_and_says_met_or_missed",  # `harness report` in a child
    "test_the_script_prepares_the_locked_kit",  # scripts/gpu_wheels.sh through pip
    # a benchmark or a real pretrained model in one test: a sweep's worth of training
    "test_bench_syncs_json", "test_bench_memory_counts_what_it_estimates",
    "test_bench_loop_precision_trains_in_that_precision",
    "test_encoder_from_a_local_folder_fine_tunes",
    "test_the_dashboard_shows_the_study_its_trials_and_the_pareto_front",  # a server, Chromium
    "test_the_dashboard_reads_a_postgresql_storage",
}
QUICK_TOOLS = {"git"}  # run by the code under test in every tier (the commit in config.yaml)


def is_integration(item: pytest.Item) -> bool:
    file = item.path.relative_to(REPO / "tests").as_posix()
    name = item.name.split("[")[0]
    quick = getattr(item.module, "QUICK", {}).get(name)  # a grid: these cases stay quick
    if quick is not None:
        return tuple(item.callspec.params.values()) not in quick  # type: ignore[attr-defined]
    return (file in INTEGRATION_FILES or name in INTEGRATION_TESTS
            or bool(INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))))


# One service, one test at a time: each group runs on one worker (ServiceGroups below), so two
# sweeps never compete for the one Slurm node's CPUs or the same database, and no GPU check
# shares the device (an over-budget batch fills it before it fails).
SERVICE_GROUPS = {"sweep/test_slurm.py": "slurm", "sweep/test_postgres.py": "postgres",
                  "gpu/test_gpu.py": "gpu"}


def service_group(nodeid: str) -> str | None:
    return SERVICE_GROUPS.get(nodeid.split("::", 1)[0].removeprefix("tests/"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)
    # The service groups first: each runs on one worker, one test after another (Slurm's ~7
    # minutes, much of it waiting on the scheduler), so started first they overlap the rest of
    # the suite instead of being its tail (collected last, they added ~5 minutes to CI's wall).
    items.sort(key=lambda item: service_group(item.nodeid) is None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`'s rule, decided here by file: xdist 3.8 marks a group by rewriting
    `item._nodeid`, which pytest 9 no longer reads (nodeid comes from `_id`), so its groups were
    silently split over workers. A service file is one scope; every other test its own."""
    from xdist.scheduler import LoadScopeScheduling

    class ServiceGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return service_group(nodeid) or nodeid

    return ServiceGroups(config, log)


@pytest.fixture(autouse=True)
def unmarked_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fails a test outside the integration tier that starts a process."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    started: list[str] = []
    start = subprocess.Popen.__init__

    def watched(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, str | os.PathLike) else list(args)
        if Path(str(argv[0]).split()[0]).name not in QUICK_TOOLS:
            started.append(" ".join(map(str, argv))[:120])
        start(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    yield
    if started:
        pytest.fail(f"started a process ({started[0]}) without the integration marker: "
                    "add the test to INTEGRATION_TESTS in tests/conftest.py")
