"""Issue 70, item 6: a trial's final model is written in the dtype it trained in: bf16-true's
all bfloat16, even where the method's export dequantizes (INT8 weights, computed in float32),
and exactly the weights its forward used; other precisions' float32 (their master weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import micro_run
from safetensors.torch import load_file

from harness.methods import build_method
from harness.methods.quant import Int8Linear
from harness.methods.resolve import load_run
from harness.modifiers.precision import pure_bf16
from harness.train import export, pretrain
from harness.train.plain import save_plain

INT8 = {"name": "apollo", "rank": 8, "update_proj_gap": 2, "int8_weights": True}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16),
                                                  ("bf16-mixed", torch.float32)])
def test_an_int8_trial_exports_its_training_dtype_and_its_forwards_weights(tmp_path, precision,
                                                                          dtype):
    """Streamed (as a trial's finish writes it) and built whole (as QLoRA's is): every tensor
    of the file in `dtype`; each INT8 linear's exported weight gives the trained layer's
    output bit for bit."""
    run = load_run({**micro_run(precision=precision), "method": INT8})
    torch.manual_seed(0)
    model, _ = pretrain.build(run)
    trained = pure_bf16(build_method(run).prepare(pure_bf16(model, run.train), run), run.train)
    state = {"model": trained.state_dict(), "step": 3}
    export.write_model(run, state, tmp_path / "streamed", 3, record=False)
    save_plain(*export.generating(run, state), tmp_path / "whole", 3, record=False)
    int8 = {n: m for n, m in trained.named_modules() if isinstance(m, Int8Linear)}
    assert int8  # the case under test: weights dequantized by the export
    for folder in ("streamed", "whole"):
        tensors = load_file(tmp_path / folder / "model.safetensors")
        assert {t.dtype for t in tensors.values()} == {dtype}, folder
        for name, layer in int8.items():
            x = torch.randn(3, layer.in_features, dtype=dtype, generator=torch.Generator()
                            .manual_seed(1))
            with torch.no_grad():
                assert torch.equal(F.linear(x, tensors[f"{name}.weight"]), layer(x)), name
