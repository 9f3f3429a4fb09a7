"""harness/modifiers/kernels.py on a CPU: liger is refused in one line where it cannot run (the
patched model's losses are checked on CUDA: tests/gpu/test_liger_kernels.py), TF32 sets CUDA's
switches alone and the meter's peak follows them, and with neither option the model is as
built."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
from conftest import micro_model, micro_run

from harness.cost import meter
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.modifiers import kernels
from harness.train import pretrain


@pytest.fixture
def tf32_switches() -> Iterator[None]:
    """CUDA's TF32 switches and oneDNN's CPU matmul precision, restored after the test."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.backends.mkldnn.matmul.fp32_precision = cpu


def test_liger_is_refused_in_one_line_without_cuda():
    """This machine has no CUDA: a run on device auto passes its config load (the trial's
    machine may have CUDA) and is refused when the trial builds its model."""
    run = load_run({**micro_run(), "model_options": {"kernels": "liger"}})
    with pytest.raises(UserError, match=r"^model_options.kernels: liger runs Triton kernels on "
                                        r"CUDA, and here no CUDA device is visible; install the "
                                        r"extra on a CUDA machine \(pip install '\.\[kernels\]'\)"):
        pretrain.build(run)
    with pytest.raises(UserError, match=r"no CUDA device is visible"):
        kernels.liger_linear_cross_entropy()
    assert not kernels.liger_available()


def test_liger_is_refused_without_triton(monkeypatch):
    """On a CUDA machine without Triton (or without the extra), the same one line names it."""
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    found = importlib.util.find_spec
    monkeypatch.setattr(kernels.importlib.util, "find_spec",
                        lambda name: None if name == "triton" else found(name))
    with pytest.raises(UserError, match=r"^model_options.kernels: liger .* and here triton is "
                                        r"not importable; "):
        kernels.check_liger()
    monkeypatch.setattr(kernels.importlib.util, "find_spec",
                        lambda name: None if name == "liger_kernel" else object())
    assert kernels.liger_missing() == "liger_kernel is not importable"


@pytest.mark.usefixtures("tf32_switches")
def test_tf32_sets_cudas_matmul_switches_and_the_meters_peak_follows(monkeypatch):
    """train.tf32 turns CUDA's TF32 matmuls on (the meter's peak is then the TF32 one: an H100
    SXM's 494.7 TFLOP/s dense, not its CUDA cores' 67); a CPU's matmuls are left as they are."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(meter.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    cuda = torch.device("cuda")
    kernels.use_tf32(load_run(micro_run()).train)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert meter.peak_flops(cuda, "32-true") == 67e12
    kernels.use_tf32(load_run(micro_run(tf32=True)).train)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu
    assert meter.peak_flops(cuda, "32-true") == 494.7e12
    assert meter.peak_flops(cuda, "bf16-mixed") == 989e12


@pytest.mark.usefixtures("tf32_switches")
def test_a_cpu_run_with_tf32_computes_what_it_computes_without():
    """Accepted on a CPU (a config that runs on a GPU also runs in CI), with no effect there:
    the logits are bitwise the ones without it, and no switch is left on for later tests."""
    ids = torch.randint(0, 100, (2, 16))
    model = micro_model(vocab=100)
    before = model(input_ids=ids).logits
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels.use_kernels(model, load_run(micro_run(tf32=True)))
    assert torch.equal(model(input_ids=ids).logits, before)
    assert not torch.backends.cuda.matmul.allow_tf32


def test_without_options_the_model_is_as_built():
    model = micro_model()
    forwards = {name: m.forward for name, m in model.named_modules()}
    assert kernels.use_kernels(model, load_run(micro_run())) is model
    assert {name: m.forward for name, m in model.named_modules()} == forwards
