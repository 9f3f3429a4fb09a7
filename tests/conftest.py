"""Shared fixtures: a micro LLaMA on the embedded sample corpus, small enough for CI.

Helpers (imported as `from conftest import ...`): `micro_run` (a run config), `micro_model` (a
small LLaMA preset, seeded), `write_c4_shards` (a local C4-layout corpus), `write_yaml`,
`harness` (the real command line in a child), `harness_here` (the same in this process).
Fixtures: `micro`, `tiny_model`, `sample_tokenizer`, `tiny_corpus`, and `finished_run` (a
sweep run once per session by the CLI's main; read-only, `finished_run_copy` for a test that
writes into it). The quick and integration tiers and the service groups: tiers.py; the
services and privileges some tests need: services.py.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import free_port
from ranks import Ranks
from services import small_disk  # noqa: F401  the fixture, found by pytest here
from tiers import (  # noqa: F401  the tiers' hooks and fixture, found by pytest here
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
    unmarked_processes,
)

# Idle OpenMP threads sleep instead of spinning (libgomp reads this as torch loads, here and in
# every child): tests run two at a time on 2 cores, and a trial's spinning threads then burn
# the other test's core. Measured: 4 trials of 2 threads at once, 35 s active, 16 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No test may reach for the hub: fail fast instead of waiting on retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_SILENT"] = "true"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What a training imports (the trial starter's list), then every object so far out of
    the collector's sight: each `train()` ends with a full `gc.collect()`, which in a test
    process walked every object the imports made, a large share of a short training.
    Objects the tests create later are collected as before."""
    from harness.sweep.run.starter import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()


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


def harness_here(*args: str) -> subprocess.CompletedProcess:
    """`harness ARGS` run by this test process, as `harness` reports it: exit code, stdout and
    stderr. For the commands no signal reaches and whose process itself is not under test: a
    sweep here skips the interpreter's imports and forks its trials from this process's fork
    server, started once instead of once a sweep."""
    from harness.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["harness", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def micro() -> dict[str, Any]:
    return micro_run()


def micro_model(seed: int | None = 0, preset: str = "llama_micro", vocab: int = SAMPLE_VOCAB,
                seq_len: int = 32, pad_id: int | None = None) -> Any:
    """A freshly initialised LLaMA preset as the trainer builds it (llama_micro: 2 layers,
    hidden 64, 1.15M parameters on the sample vocabulary); `seed` seeds torch first (None:
    the global generator as it stands)."""
    import torch

    from harness.train.build import build_model

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
    per session by the command's `main` (`harness_here`). Shared: read it, never write into it
    (use `finished_run_copy` for that)."""
    root = tmp_path_factory.mktemp("finished")
    path = write_yaml(root / "finished.yaml", FINISHED_SWEEP)
    done = harness_here("sweep", str(path), "--out", str(root / "runs"), "--jobs", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return root / "runs"


@pytest.fixture
def finished_run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A private copy of `finished_run`, for a test that writes a report or changes a trial."""
    return Path(shutil.copytree(finished_run, tmp_path / "runs"))


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread for the block (as each forked rank runs), as it was after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread():
    """OpenMP threads spin-wait when 2 cores are oversubscribed (a CI box running other work),
    which turns a 1 s SVD into a minute; one thread keeps test times steady."""
    with one_torch_thread():
        yield


def assert_estimate_matches(estimate: Any, summary: dict[str, Any]) -> None:
    """The analytic prediction equals the bytes counted from the trained model's tensors."""
    assert estimate.weight_bytes == summary["param_bytes"]
    assert estimate.grad_bytes == summary["grad_bytes"]
    assert estimate.optimizer_state_bytes == summary["optimizer_state_bytes"]
    assert estimate.extra_bytes == summary["extra_bytes"]


def train_losses(trial_dir: Path) -> dict[int, float]:
    """Logged training loss by step, for comparing an interrupted run with a clean one."""
    from harness.trials import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(trial_dir / "metrics.jsonl")
            if r["kind"] == "train"}


# A test that signals a trial once it has logged step k gives it k + STEPS_LEFT steps, so the
# signal lands while it trains. On the fastest CPU measured, 150 of llama_micro's steps take
# some twenty times the window of the 9 steps left that a trial once finished in before its
# signal came (CI, tests/sweep/test_faults.py, its poller sharing the cores with another
# xdist worker).
STEPS_LEFT = 150


def wait_for_step(trial_dir: Path, step: int, timeout_s: float = 300) -> None:
    """Until the trial has logged `step`; it polls every 50 ms, so that a signal sent next
    comes within a few steps of it."""
    import time

    deadline = time.time() + timeout_s
    while max(train_losses(trial_dir), default=0) < step:
        assert time.time() < deadline, f"{trial_dir} never reached step {step}"
        time.sleep(0.05)


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


def ranks(config: Path, out: Path, procs: int = 2) -> Ranks:
    """`harness train` data-parallel, its ranks forked warm (tests/ranks.py): what `torchrun`
    below starts, at a fraction of the CPU."""
    return Ranks(["train", str(config), "--out", str(out)], procs, free_port())


def torchrun(config: Path, out: Path, procs: int = 2) -> subprocess.Popen:
    """`harness train` as a user starts it data-parallel: 2 processes (gloo on CPU), each on one
    thread so that kernels sum in the same order as the 1-process reference."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
           "--master_port", str(free_port()), "-m", "harness.cli", "train", str(config),
           "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_two_processes_train_as_one(data: dict[str, Any], tmp_path: Path) -> None:
    """`data` on 2 ranks and here in one: both ok, the same logged steps,
    every loss within 1e-5 relative."""
    from harness.methods.resolve import load_run
    from harness.train import train
    from harness.trials import read_json

    proc = ranks(write_yaml(tmp_path / "run.yaml", data), tmp_path / "two")
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


def hf_eval_loss(folder, task: dict, tokens: int) -> float:
    """Mean next-token loss of the model transformers loads from `folder`, on the validation
    tokens every trial evaluates (the first `tokens` targets of the sample's split), summed
    in float64 as the trial sums them."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.config import TaskConfig
    from harness.data.c4 import eval_blocks

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    blocks = eval_blocks(TaskConfig(**task), tok, tokens)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, n in blocks:
            x = torch.from_numpy(ids.astype("int64"))[None, :n]
            logits = model(input_ids=x).logits[0, :-1]
            total += float(F.cross_entropy(logits, x[0, 1:], reduction="sum").double())
            count += n - 1
    return total / count


def estimated_peak(run: Any, device: str = "cpu") -> int:
    """`run`'s predicted step peak (the activation model) on the sample tokenizer's vocab."""
    from harness.cost.activations import activations, peak_bytes
    from harness.methods import build_memory
    from harness.models import param_shapes

    shapes = param_shapes(run.model, SAMPLE_VOCAB)
    memory = build_memory(run)
    return peak_bytes(memory.estimate(shapes, run), activations(run, shapes, memory, device),
                      run, shapes)


def measured_peak(run: Any, breakdown: bool = False) -> tuple[int, dict[str, int]]:
    """A steady step's peak of live tensors, as `harness bench memory` measures it; with
    `breakdown`, its bytes by the profiler's categories too (CPU)."""
    import tempfile

    from harness.cost.tensor_peak import step_peak
    from harness.train import Trainer
    from harness.trials import Records

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, Records(Path(out), run), lambda step: False)
        try:
            return step_peak(trainer, breakdown)
        finally:
            trainer.close()
