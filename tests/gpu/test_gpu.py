"""What a lent CUDA device checks first (`pytest -m gpu`; gpu_setup.py says where and which
cases, and which pairs a method meets): every method trains with every optimizer-side memory
modifier and precision it can tell apart, every modifier with every precision, with finite
losses, or is refused at load time as expected; a stopped run resumes exactly for each kind of
device state; bitsandbytes' 8-bit and NF4 kernels run on the device; in a sweep an injected NaN
ends its trial `nan`, an over-budget batch ends `oom`, and the sweep carries on.

Sized for the 8 minutes a device command may spend on them (10 at most): 90 trained + 6
resumed x 3 + 3 bitsandbytes = 111 short llama_60m trainings (4 steps of 2 x 4 x 128 tokens,
an eval and a checkpoint each; KIT_TRAININGS bounds them), then the sweep's 3 processes: 132
tests here, 135 with the fused-loss and Liger ones. The smoke form
(`HARNESS_GPU_SMOKE=1 pytest -n0 -m gpu tests/gpu`, 42 tests here) runs on a CPU, most of its
time the sweep's processes.
"""

from __future__ import annotations

import math
import resource
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import assert_resumes_exactly, train_losses, write_yaml
from gpu_setup import (
    ALL,
    CUDA,
    CUDA_RESUMED,
    CUDA_TRAINED,
    DEVICE,
    MODIFIERS,
    PRECISIONS,
    REFUSED,
    RESUMED,
    RESUMED_METHODS,
    SHAPE,
    SKIP_REASON,
    SMOKE,
    STEPS,
    STOP,
    TRAINED,
    Case,
    pairs,
    refusal,
    run_config,
)
from method_matrix import MODEL_METHODS
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.errors import UserError
from harness.methods.base import method_names
from harness.methods.resolve import load_run
from harness.models import PRESETS
from harness.modifiers.optimizer import unwrap
from harness.train import Trainer, train
from harness.trials import Records, Status, read_json

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or SMOKE), reason=SKIP_REASON)]
# The trainings a CUDA run of the cases may hold (the module docstring): past it, resize them.
KIT_TRAININGS = 112


@pytest.fixture(autouse=True)
def no_cpu_tensor_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The smoke form leaves out the CPU's tensor-peak profiler (harness/cost/tensor_peak.py),
    which a CUDA run never starts: its start alone takes 1.3 s a training here."""
    if SMOKE:
        monkeypatch.setattr("harness.train.run.tracked", lambda trainer, enabled: nullcontext())


def ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


def assert_finite_losses(out: Path) -> None:
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(map(math.isfinite, losses.values())), losses


def assert_trained(summary: dict, out: Path) -> None:
    """Ended ok on DEVICE with a finite loss at every step and at the eval."""
    assert summary["status"] == "ok", summary["error"]
    assert summary["device"] == DEVICE and math.isfinite(summary["eval_loss"])
    assert_finite_losses(out)


def test_the_cases_cover_every_method_modifier_and_precision():
    """On CUDA (the cases checked here in either mode): every registered method trains, and
    every accepted case's method meets its modifier and its precision, but for what the method
    cannot tell apart: Kahan summation meets it as bf16-true, and a method that keeps the model
    (not in MODEL_METHODS) meets recompute and activation offload as plain, 32-true, bf16-mixed
    and 16-mixed as one. Every accepted modifier and precision meet; RESUMED_METHODS resume,
    on the device; the kit keeps its size; a case of each pair the config refuses is refused.
    In the smoke form every modifier and precision trains."""
    cases = CUDA_TRAINED + CUDA_RESUMED
    assert {c.method for c in cases} == set(method_names())
    assert {c.method for c in CUDA_RESUMED} == set(RESUMED_METHODS) <= set(method_names())
    assert "offload_host" not in {c.modifier for c in CUDA_RESUMED}
    assert len(CUDA_TRAINED) + 3 * len(CUDA_RESUMED) + len(BNB_CASES) <= KIT_TRAININGS

    def modifiers(method: str, modifier: str) -> set[str]:
        keeps = method not in MODEL_METHODS and modifier in ("plain", "recompute", "offload")
        return {"plain", "recompute", "offload"} if keeps else {modifier}

    def precisions(method: str, precision: str) -> set[str]:
        if precision in ("bf16-true", "bf16-true-kahan"):
            return {"bf16-true", "bf16-true-kahan"}
        keeps = method not in MODEL_METHODS and precision in ("32-true", "bf16-mixed", "16-mixed")
        return {"32-true", "bf16-mixed", "16-mixed"} if keeps else {precision}

    accepted = [c for c in ALL if refusal(c) is None]
    for c in accepted:
        assert any(d.method == c.method and d.modifier in modifiers(c.method, c.modifier)
                   for d in cases), c
        assert any(d.method == c.method and d.precision in precisions(c.method, c.precision)
                   for d in cases), c
        assert any(d[1:] == c[1:] for d in cases), c
    assert set().union(*map(pairs, REFUSED)) >= (set().union(*map(pairs, ALL))
                                                 - set().union(*map(pairs, accepted)))
    ran = TRAINED + RESUMED  # this mode's
    assert {c.modifier for c in ran} == set(MODIFIERS)
    assert {c.precision for c in ran} == set(PRECISIONS)


@pytest.mark.parametrize("case", REFUSED, ids=ids(REFUSED))
def test_refused_at_load_time_with_the_reason(case):
    with pytest.raises(UserError) as e:
        load_run(run_config(case))
    assert str(e.value).startswith(refusal(case)) and len(str(e.value)) > 60, str(e.value)


# The sharpest CUDA-only claims first: the kit may cut the part off at its time cap.
BNB_CASES = [Case("adam8bit", "plain", "bf16-mixed"),
             Case("adam8bit", "offload_paged", "bf16-mixed"), Case("qlora", "plain", "bf16-mixed")]


@pytest.mark.parametrize("case", BNB_CASES, ids=ids(BNB_CASES))
def test_bitsandbytes_kernels_run_on_the_device(tmp_path, case):
    """8-bit Adam's moments are uint8 on the device (paged: in bitsandbytes' unified memory
    on CUDA); QLoRA's base weights are NF4 Params4bit on the device, and training ran through
    them."""
    import bitsandbytes as bnb

    run = load_run(run_config(case))
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        assert trainer.fit() == Status.OK
        if case.method == "qlora":
            weights = [m.weight for m in trainer.model.modules()
                       if isinstance(m, bnb.nn.Linear4bit)]
            assert len(weights) == 7 * PRESETS[SHAPE["model"]].layers  # every targeted linear
            assert all(isinstance(w, bnb.nn.Params4bit) and w.dtype == torch.uint8
                       and w.quant_state.quant_type == "nf4" for w in weights)
            assert {w.device.type for w in weights} == {DEVICE}
        else:
            states = [s for opt in unwrap(trainer.optimizer) for s in opt.state.values()]
            moments = [s[k] for s in states for k in ("state1", "state2")]
            assert sum(m.dtype == torch.uint8 for m in moments) > len(moments) / 2
            # On CUDA bitsandbytes pages the moments of 1e5 entries or more, in unified memory
            # (a CPU tensor to torch); on CPU it pages nothing.
            paged = [getattr(m, "is_paged", False) for m in moments]
            expect = CUDA and case.modifier == "offload_paged"
            assert paged == [expect and m.numel() >= 100_000 for m in moments]
            assert {m.device.type for m, p in zip(moments, paged, strict=True) if not p} == {DEVICE}
        assert_finite_losses(tmp_path)
    finally:
        trainer.close()


# Far beyond any device: at llama_60m, 8192 x 128 tokens keep ~490 GB of activations (32-true,
# ~470 KB a token), more than any GPU's memory. In the smoke form, 2048 x 32 tokens' logits (8192
# x 4 B each: 2.1 GB, and their gradient as large at the start of backward) on top of the
# ~3 GB a llama_micro trial maps exceed the address space it gets (LIMIT_AS).
OOM_BATCH = 8192 if CUDA else 2048
LIMIT_AS = 6 << 30
OOM_ERROR = "CUDA out of memory" if CUDA else "can't allocate memory"


def limit_memory() -> None:
    """The smoke form's over-budget batch: the sweep and its trials may map LIMIT_AS bytes,
    so that a real allocation fails as it would when the host runs out."""
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def test_an_oom_and_a_nan_end_their_trials_and_the_sweep_carries_on(tmp_path):
    """`harness sweep`, one trial at a time: an over-budget batch (a real allocator failure)
    ends `oom`, then the next trial runs, where a learning rate of 1e30 makes the loss NaN:
    `nan` at its step; the sweep exits 1."""
    base = run_config(Case("full", "plain", "32-true"))
    sweep = {
        "name": "faults", **{k: base[k] for k in ("model", "device", "task", "train", "eval")},
        "methods": {
            "oom": {"method": "full", "train": {"batch_size": OOM_BATCH,
                                                "total_batch_size": OOM_BATCH}},
            "nan": {"method": "full", "train": {"lr": 1e30}},
        },
    }
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "sweep", str(write_yaml(tmp_path / "f.yaml", sweep)),
         "--out", str(out), "--jobs", "1"],
        capture_output=True, text=True, timeout=300, preexec_fn=None if CUDA else limit_memory)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    trials = {s["method"]: s for s in map(read_json, out.glob("trials/*/summary.json"))}
    assert {label: s["status"] for label, s in trials.items()} == {"oom": "oom", "nan": "nan"}
    assert OOM_ERROR in trials["oom"]["error"]
    assert trials["nan"]["error"].startswith("loss is ") and trials["nan"]["nan_step"] <= STEPS
    assert trials["nan"]["device"] == DEVICE
    oom, nan = (done.stdout.index(f"[{trials[label]['trial']}]") for label in ("oom", "nan"))
    assert oom < nan  # the oom trial ran first, then the sweep went on


@pytest.mark.parametrize("case", TRAINED, ids=ids(TRAINED))
def test_trains_with_finite_losses(tmp_path, case):
    summary = train(load_run(run_config(case)), tmp_path / "t")
    assert_trained(summary, tmp_path / "t")


@pytest.mark.parametrize("case", RESUMED, ids=ids(RESUMED))
def test_resumes_exactly(tmp_path, case):
    """Stopped after step STOP and resumed: every loss equals a run never stopped. On the math
    attention kernel: flash and memory-efficient attention's backward add up with atomics on
    CUDA, so that two runs differ in the last bits (torch.use_deterministic_algorithms would
    fix that, but refuses ReLoRA's kthvalue on CUDA)."""
    with sdpa_kernel(SDPBackend.MATH):
        assert_resumes_exactly(load_run(run_config(case)), tmp_path, stop=STOP)
    assert_trained(read_json(tmp_path / "resumed" / "summary.json"), tmp_path / "resumed")
