"""The 2025 optimizer studies' published numbers (analysis/paper/*.csv) beside a sweep's.

- `s4s_screening`: Scaling for Scaling's Stage-1 table (OpenRaiser/scaling-for-scaling,
  `data/table-ledger.json`, `tab:c4_llama3_full_screening`): C4 validation perplexity,
  optimizer-state GB and step time (ms) of 24 optimizers at 60M, 130M, 350M and 1B, sequence
  length 256. Its model configs are GaLore's LLaMA sizes, so presets map as `paper.SIZES`, and
  methods as `paper.PAPER_ROWS` (full → AdamW, galore → GaLore, apollo → APOLLO, adam8bit →
  Adam8bit, adam_mini → Adam-mini, muon → Muon, soap → SOAP, lion → Lion, came → CAME, mars →
  MARS-AdamW). The optimizers no harness method runs (Adan, RAdam, NAdam, Prodigy, AdaBelief,
  MARS-Shampoo, MARS-Lion, RMNP, Shampoo, Conda, Adafactor, AdamP, LAMB, Sophia) stay in the
  file for reading and are compared with nothing. `compare_anchors` sets perplexity and
  optimizer-state GB beside ours, each with `differs`/`unknown` against the recipe recorded
  in settings.csv; step time is kept for the reader only: it was timed on the authors'
  multi-GPU nodes.
- `marin_speedup`: marin's "Fantastic Pretraining Optimizers" (arXiv:2509.02046) speedups over
  tuned AdamW, as far as a readable source states them: the abstract's two figures for the
  matrix-based optimizers (Muon, Soap), at 0.1B and 1.2B, its Chinchilla multiple unstated.
  `marin_rows` picks the rows for a method, preset and multiple; `with_marin` adds them to a
  speedup table, `marin_column` gives the report's speedup table its `marin` column.
- Glentis et al. (arXiv:2505.22922) ships no rows: its perplexity table could not be read
  from any stored source (docs/reports.md, "Published numbers").
"""

from __future__ import annotations

import math

import pandas as pd

from .paper import (
    PAPER_ROWS,
    SIZES,
    VARIANT,
    compare_frame,
    compare_pretrain,
    compare_row,
    members,
    task_kind,
    variants,
)
from .recipe import departures, load_paper, recipe
from .stats import at_best, best_lr

S4S = "s4s_screening"
MARIN = "marin_speedup"
# Our method -> marin's row name: the abstract speaks of the matrix-based optimizers together.
MARIN_METHODS = {"muon": "Matrix-based (Muon, Soap)", "soap": "Matrix-based (Muon, Soap)"}
# Our preset -> marin's size where both count the same block (attention + MLP) parameters:
# llama_1b 24 x (4·2048² + 3·2048·5461), marin's 1.2b 32 x (4·1536² + 3·1536·6144), both
# 1.208e9 (marin-community/marin experiments/optimizer_sweep/Analysis/PhaseII/
# speedup_estimation.py). No preset has marin's 0.1B (130m) blocks.
MARIN_SIZES = {"llama_1b": "1.2B"}


def compare_anchors(trials: pd.DataFrame) -> pd.DataFrame:
    """Scaling for Scaling's perplexity and optimizer-state GB next to ours, at each of our
    configurations' best LR, for the same method and model size."""
    frames = [f for f in (compare_pretrain(trials, (S4S,)), compare_state(trials)) if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else compare_frame([])


def compare_state(trials: pd.DataFrame) -> pd.DataFrame:
    """Optimizer-state GB (10^9 bytes, the largest over the chosen LR's seeds) next to Scaling
    for Scaling's; a configuration whose trials recorded none is left out."""
    ours = variants(trials)
    ours = ours[(task_kind(ours) == "pretrain") & ours["model"].isin(list(SIZES))
                & ours["key"].notna()]
    keys = [*VARIANT, "steps", "key"]
    picks = best_lr(ours, keys)
    state = at_best(ours, picks, keys, "optimizer_state_bytes", "max") / 1e9
    paper = load_paper(S4S)
    rows = []
    for i, pick in zip(picks.index, picks.to_dict("records"), strict=True):
        if pd.isna(state[i]):
            continue
        same = paper[paper["method"].isin(PAPER_ROWS[pick["key"]])
                     & (paper["model"] == SIZES[pick["model"]])]
        group = members(ours, pick, keys)
        stat = {**pick, "mean": state[i], "ci": math.nan}
        for ref in same.to_dict("records"):
            checked = departures(group, recipe(S4S, ref["method"], ref["model"]))
            rows.append(compare_row(stat, ref["model"], "optimizer state (GB)", ref["state_gb"],
                                    ref["source"], checked))
    return compare_frame(rows)


def marin_rows(method: str, model: str | None = None,
               chinchilla: float | None = None) -> pd.DataFrame:
    """marin's speedup rows for our `method`, at our preset `model`'s size (None: every size;
    a preset of no marin size: none) and at `chinchilla` times the Chinchilla tokens (None:
    any); a row whose multiple the source does not state is kept for every multiple and
    comes after one stating it."""
    rows = load_paper(MARIN)
    rows = rows[rows["method"] == MARIN_METHODS.get(method)]
    if model is not None:
        rows = rows[rows["model"] == MARIN_SIZES.get(model)]
    if chinchilla is not None:
        rows = rows[rows["chinchilla"].isna() | (rows["chinchilla"] == chinchilla)]
    return rows.sort_values("chinchilla", na_position="last", kind="stable")


def with_marin(table: pd.DataFrame) -> pd.DataFrame:
    """A speedup table (columns `method`, `model` and, where it has one, `chinchilla`) with
    marin's speedup and its source beside each row: NaN and "" where marin states none."""
    found = [marin_rows(row["method"], row["model"], row.get("chinchilla"))
             for row in table.to_dict("records")]
    firsts = [rows.iloc[0] if len(rows) else None for rows in found]
    return table.assign(
        marin_speedup=[math.nan if r is None else float(r["speedup"]) for r in firsts],
        marin_source=["" if r is None else r["source"] for r in firsts])


def marin_column(points: pd.DataFrame) -> list[str]:
    """A speedup table's cells for marin (rows: `method`, `model` and, where it has one,
    `chinchilla`): its published speedup as "1.10×", "" where it states none."""
    marin = with_marin(points)["marin_speedup"]
    return ["" if math.isnan(v) else f"{v:.2f}×" for v in marin]
