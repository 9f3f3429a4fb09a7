"""The report's sections on budgets and sizes: speedup over tuned AdamW (speedup.csv, .md,
speedup.png) and scaling across model sizes (scaling.csv, .md, scaling.png). A sweep without
the budgets or sizes a fit needs gets one line saying what is missing instead, never a number.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.trials import atomic_write

from .anchors import marin_column
from .fit_figures import scaling_figure, speedup_figure
from .format import text_table
from .html import Block, Heading, Image, Paragraph, Table
from .plots import save_png
from .scaling import fit_note, scaling, scaling_table
from .speedup import BASELINE, fit_lines, speedup_table, speedups

SPEEDUP_TITLE = "Speedup over tuned AdamW"
MARIN_COLUMN = "marin (arXiv:2509.02046)"  # its stated speedup for the method and size
SCALING_TITLE = "Scaling across model sizes"
SPEEDUP_NOTE = (
    "Per model and token budget, each method at its best LR (lowest seed-mean final eval loss). "
    "AdamW's best losses are fitted with L(D) = E + A·D^−α; a method's speedup is the tokens "
    "AdamW would need for its loss, D_AdamW(L) = (A/(L − E))^(1/α), over the tokens it used. "
    "95% interval: the method's Student-t interval over seeds mapped through D_AdamW (the fit's "
    "own error, the ± of its parameters, is not in it). AdamW's own rows show how far its "
    "points lie off its law.")


def protocol_sections(trials: pd.DataFrame, name: str, out: Path,
                      baseline: str = BASELINE) -> tuple[list[Block], list[str]]:
    """The report's blocks and the terminal's texts for both sections."""
    blocks, texts = _speedup_section(trials, name, out, baseline)
    more, text = _scaling_section(trials, name, out, baseline)
    return [*blocks, *more], [*texts, text]


def _speedup_section(trials: pd.DataFrame, name: str, out: Path,
                     baseline: str) -> tuple[list[Block], list[str]]:
    result = speedups(trials, baseline)
    lines = fit_lines(result)
    if not result.fits:
        why = " ".join(lines) or "no trial finished with a final eval loss."
        line = f"{SPEEDUP_TITLE}: not computed. {why}"
        return [Paragraph(line)], [line]
    table = speedup_table(result).assign(**{MARIN_COLUMN: marin_column(result.points)})
    _write(out, "speedup", SPEEDUP_TITLE, " ".join([SPEEDUP_NOTE, *lines]), table)
    image = Image(out / "speedup.png", save_png(*speedup_figure(result, name),
                                                out / "speedup.png"))
    blocks: list[Block] = [Heading(SPEEDUP_TITLE), Paragraph(SPEEDUP_NOTE),
                           *map(Paragraph, lines), Table(table), image]
    return blocks, [f"{SPEEDUP_TITLE}\n" + "\n".join(lines) + f"\n{text_table(table)}"]


def _scaling_section(trials: pd.DataFrame, name: str, out: Path,
                     baseline: str) -> tuple[list[Block], str]:
    result = scaling(trials, baseline)
    sizes = sorted(set(result.points["model"].astype(str)))
    if not result.fits:
        line = (f"{SCALING_TITLE}: not fitted. A power law in parameters needs at least 2 model "
                f"sizes with a finished trial of one method; this sweep has {len(sizes)}"
                f"{' (' + ', '.join(sizes) + ')' if sizes else ''}.")
        return [Paragraph(line)], line
    table = scaling_table(result)
    note = " ".join([fit_note(result), *result.missing])
    _write(out, "scaling", SCALING_TITLE, note, table)
    image = Image(out / "scaling.png", save_png(*scaling_figure(result, name),
                                                out / "scaling.png"))
    blocks: list[Block] = [Heading(SCALING_TITLE), Paragraph(note), Table(table), image]
    return blocks, f"{SCALING_TITLE}\n{text_table(table)}\n{note}"


def _write(out: Path, slug: str, title: str, note: str, table: pd.DataFrame) -> None:
    atomic_write(out / f"{slug}.csv", table.to_csv(index=False))
    atomic_write(out / f"{slug}.md", f"# {title}\n\n{note}\n\n{text_table(table)}\n")
