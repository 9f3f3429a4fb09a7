"""The entries of GaLore's per-parameter optimizer state by what they are (methods/galore_optim.py
keeps them; the estimators count them; fsdp splits them): the projection bases, the inner
optimizer's moments and, for the 8-bit one, its quantization maps and per-block scales."""

from __future__ import annotations

BASIS_KEYS = ("left", "right")  # projection matrices: extra bytes, not optimizer state
QMAPS = ("qmap1", "qmap2")  # 8-bit states' quantization maps: the same on every rank
ABSMAX = ("absmax1", "absmax2")  # 8-bit states' per-block scales: under fsdp, a rank's blocks
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col",
               "state1", "state2", "absmax1", "absmax2")
# fsdp, a left (or full) side: what is not kept by W's rows (P is); a left side's moments are
# kept by their own r rows (SPLIT, the 8-bit ones' absmax by blocks)
LEFT_WHOLE = (*MOMENT_KEYS, "right", *QMAPS)
SPLIT = ("exp_avg", "exp_avg_sq", "state1", "state2")
