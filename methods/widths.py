"""Bytes per stored element by precision: what every method's `estimate` and the activation
model (harness/cost/activations.py) multiply element counts by, in one place.

- `32-true`, `bf16-mixed`, `16-mixed`: float weights, gradients and 32-bit optimizer states
  are fp32 (autocast computes in 2 bytes but keeps fp32 weights; it adds 2-byte copies of
  linear inputs and weights, which the activation model counts);
- `bf16-true`: the whole model (norms and embeddings too) is bfloat16, so are gradients and
  activations; 32-bit optimizer states follow `train.state_dtype` (the GaLore reference code's
  Adam states follow the parameter dtype: bfloat16); `update_compensation: kahan` keeps one
  bf16 compensation buffer per trained weight element (counted as optimizer state);
  stochastic rounding keeps nothing. GaLore's SVD runs in fp32, the basis is stored in the
  weight's dtype (bf16, as the reference code does).
8-bit optimizer states stay 8-bit in every mode; tensors below `min_8bit_size` keep 32-bit
moments at the state width (bitsandbytes: float32; the harness's 8-bit kernel under bf16-true:
train.state_dtype). INT8/INT4 codes stay what they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.config import RunConfig

STATE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Widths:
    weight: int  # a float weight (and a float basis: GaLore's projections)
    grad: int  # a gradient of a float weight
    state: int  # one 32-bit optimizer state element (an Adam moment, an Adafactor factor)
    activation: int  # an activation a linear or attention computes
    autocast: bool  # bf16-mixed / 16-mixed: 2-byte copies of linear inputs and weights
    compensation: int  # kahan: a bf16 buffer per trained weight element

    @property
    def pure(self) -> bool:
        """bf16-true: no fp32 copy of anything the model holds."""
        return self.weight == 2


def widths(run: RunConfig) -> Widths:
    t = run.train
    if t.precision == "bf16-true":
        kahan = 2 if t.update_compensation == "kahan" else 0
        return Widths(2, 2, STATE_BYTES[t.state_dtype], 2, False, kahan)
    mixed = t.precision in ("bf16-mixed", "16-mixed")
    return Widths(4, 4, 4, 2 if mixed else 4, mixed, 0)
