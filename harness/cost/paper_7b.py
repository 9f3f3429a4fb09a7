"""The published LLaMA-7B single-device memory figures beside `harness estimate`'s, term by term.

GaLore (Zhao et al., 2024) §1 / Fig. 1 and §5.5: pretraining LLaMA-7B on one device at a token
batch of 256, no activation checkpointing, no offloading, the whole model in bfloat16. Its
figures stack weights, gradients, optimizer states and activations as if all were alive at
once: BF16 AdamW 58 GB (14 + 42 + 2), 8-bit GaLore layer-wise (rank 1024) 22.0 GB, and 8-bit
Adam 22.0 + the 24.5 GB 8-bit GaLore is said to save = 46.5 GB. Q-GaLore: the reference script
for this setting (VITA-Group/Q-GaLore scripts/single_gpu/llama_7b.sh, batch 1 × 256 tokens)
says "Memory cost: 15.08 G" (the paper's table: 15 G). Our side: the same sum of the parts
(weights + gradients + optimizer states + extras + activations at the start of backward), and
the step's peak, which is lower where gradients and activations are never alive together.
Where a figure is more than 10% away, docs/estimate.md says which term differs and why.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from harness.config.steps import Steps

if TYPE_CHECKING:
    from harness.config import SweepConfig

TOKENS = 256  # the paper's token batch: one micro-batch, no accumulation
RANK = 1024
TOLERANCE = 0.10
TABLE_WIDTH = 120  # a terminal's columns, as the estimate's own table keeps to
PAPER_7B = {  # row -> (GB, source)
    "BF16 AdamW": (58.0, "GaLore Fig. 1: 14 weights + 42 grads and states + 2 activations"),
    "8-bit Adam": (46.5, "GaLore §5.5: 22.0 + the 24.5 GB 8-bit GaLore saves"),
    "8-bit GaLore layer-wise": (22.0, "GaLore §5.5, rank 1024"),
    "Q-GaLore": (15.08, "Q-GaLore's llama_7b.sh (paper: 15 G)"),
}


def paper_row(record: dict[str, Any], layerwise: bool) -> str | None:
    """The published figure that a trial of this sweep reproduces (None: none does)."""
    name, p = record["method_name"], record["params"]
    if name == "full" or name == "adam8bit":
        return "BF16 AdamW" if name == "full" else "8-bit Adam"
    if p.get("rank") != RANK:
        return None
    if name == "galore" and p.get("optimizer") == "adam8bit" and layerwise:
        return "8-bit GaLore layer-wise"
    if name == "qgalore" and p.get("optimizer", "adam8bit") == "adam8bit" and not p.get("simulate"):
        return "Q-GaLore"
    return None


def parts_bytes(record: dict[str, Any]) -> int:
    """The paper's accounting: every term added, as Fig. 1 stacks them."""
    return record["total_bytes"] + record["activation_bytes"]


def paper_setting(sweep: SweepConfig) -> bool:
    t = sweep.train
    return (t.precision == "bf16-true" and t.batch_size * sweep.task.seq_len == TOKENS
            and Steps.of(t, sweep.task.seq_len).accumulation == 1)  # fmt: skip


def layerwise_of(sweep: SweepConfig, label: str) -> bool:
    memory = (sweep.methods.get(label) or {}).get("memory") or {}
    return bool(memory.get("layerwise", sweep.memory.layerwise))


def comparison_7b(records: list[dict[str, Any]], sweep: SweepConfig) -> str:
    """Our 7B figures next to the papers' ('' off the paper's setting or without a match)."""
    if not paper_setting(sweep):
        return ""
    rows, sources, seen = [], [], set()
    for r in records:
        row = paper_row(r, layerwise_of(sweep, r["method"]))
        if row is None or r["method"] in seen:
            continue
        seen.add(r["method"])
        gb, source = PAPER_7B[row]
        cells = []
        for ours in (parts_bytes(r), r["peak_bytes"]):
            diff = ours / (gb * 1e9) - 1
            cells += [f"{ours / 1e9:.2f}", f"{diff:+.1%}{' !' if abs(diff) > TOLERANCE else ''}"]
        rows.append([r["method"], row, f"{gb:.2f}", *cells])
        sources.append(f"  {row}: {source}")
    if not rows:
        return ""
    headers = ["method", "paper", "paper GB", "ours: sum of parts", "diff", "ours: peak", "diff"]
    note = (f"\n! more than {TOLERANCE:.0%} apart: docs/estimate.md says which term differs"
            if any(" !" in c for row in rows for c in row) else "")
    title = textwrap.fill(
        "LLaMA-7B, one device, 1 x 256 tokens, bf16-true, decimal GB; the papers add every term "
        "(weights + grads + optimizer + extra + activations), the peak is the largest moment "
        "of a step", TABLE_WIDTH)
    return (f"{title}\n{tabulate(rows, headers=headers, disable_numparse=True)}{note}\n"
            "published as:\n" + "\n".join(sources))
