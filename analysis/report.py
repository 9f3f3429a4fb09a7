"""Turn loaded runs into the report a sweep is judged by: tables, figures, report.md/html.

Each method is compared at its own best learning rate (lowest final eval perplexity among
trials that finished), the protocol of the papers this harness compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from harness.config.metrics import METRICS, REGISTRY
from harness.trials import RunsDir, Status, atomic_write

from .caveats import annotate, conditions_line, with_conditions
from .cost_front import cost_section
from .downstream import downstream_section
from .figures import (
    best_lr_trials,
    eval_curves,
    loss_curves,
    optuna_figures,
    pareto_plot,
    throughput_chart,
)
from .format import (
    VARIANT_DEFAULTS,
    fill_variants,
    metric_cell,
    ordered,
    text_table,
    variant_label,
)
from .front import front_line, front_table, objectives_of
from .html import Block, Heading, Image, Paragraph, Preformatted, Table, write_html
from .load import PathArg, Paths, load_runs, load_steps, read_sweep, run_dirs
from .paper import task_kind
from .plots import PER_TRIAL, curves_plot, memory_chart, save_png
from .protocol import protocol_sections
from .stats import at_best_lr
from .tables import write_tables
from .tuning import tuning_section
from .unreadable import unreadable_note, with_mark

PICKED_BY = "eval_ppl"  # the metric whose seed-mean picks each method's best LR
SHOWN = tuple(m.name for m in REGISTRY if m.report)  # the registry's report columns
SUMMARY_COLUMNS = ("method", "memory", "precision", "best lr",
                   *(METRICS[m].header for m in SHOWN), "trials")
VARIANT = list(VARIANT_DEFAULTS)  # what a row of the summary compares
MEMORY_NOTE = "Memory columns use decimal units: 1 MB = 10^6 bytes, 1 GB = 10^9 bytes."


def summary_table(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """One row per method and memory modifiers at its best LR; methods named in `order`
    (sweep.yaml) come first, each one's modifier variants in the order they appear."""
    trials = fill_variants(trials)
    rows = []
    for label in ordered(trials["method"].astype(str), order):
        own = trials[trials["method"].astype(str) == label]
        for key, group in own.groupby(VARIANT, sort=False):
            row = _method_row(dict(zip(VARIANT, key, strict=True)), group)
            rows.append({**row, "best lr": with_mark(row["best lr"], group)})  # may be wrong
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def write_report(paths: Paths, out: PathArg | None = None) -> str:
    """Write the report folder (default: the first runs directory's report/): trials.csv, each
    table as csv and md, the figures as png, report.md and report.html (one self-contained
    file); return the tables for the terminal."""
    dirs = run_dirs(paths)
    trials = with_conditions(load_runs(dirs))  # who shared the machine, for tok/s and hours
    steps = load_steps(dirs, trials)
    sweep = read_sweep(dirs[0])
    name = str(sweep.get("name") or dirs[0].resolve().name)
    order = _sweep_methods(sweep)
    out = Path(out) if out else RunsDir(dirs[0]).report
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "trials.csv", trials.to_csv(index=False))
    pretraining = trials[task_kind(trials) != "glue"]
    note = [str(sweep["note"])] if sweep.get("note") else []
    damaged = unreadable_note(trials)  # every record that cannot be read, before any table
    blocks: list[Block] = [*map(Paragraph, note), Paragraph(
        f"{len(trials)} trials in {', '.join(map(str, dirs))}. {MEMORY_NOTE}"),
        *map(Paragraph, damaged)]
    terminal = [*note, *damaged]
    if not pretraining.empty or len(trials) == 0:
        table = summary_table(pretraining, order=order)
        marked, caveats = annotate(table, pretraining)  # †, ‡, § and the notes saying why
        caveats.append(conditions_line(pretraining))
        blocks += [Heading("Methods at their best learning rate"), Table(marked),
                   Paragraph(best_lr_line(table)), *map(Paragraph, caveats)]
        terminal.append("\n".join([text_table(marked), *caveats]))
        objectives = objectives_of(sweep, pretraining)
        front = front_table(pretraining, objectives)
        blocks += [Heading("Pareto front"), Table(front),
                   Paragraph(front_line(pretraining, front, objectives))]
        terminal.append(f"Pareto front\n{text_table(front)}")
        cost_blocks, cost_text = cost_section(pretraining, order, name, out)
        blocks += cost_blocks
        terminal += [cost_text] if cost_text else []
        fit_blocks, fit_texts = protocol_sections(pretraining, name, out)  # speedup, scaling
        blocks, terminal = [*blocks, *fit_blocks], [*terminal, *fit_texts]
        tune_blocks, tune_texts = tuning_section(pretraining, sweep)  # tuned values
        blocks, terminal = [*blocks, *tune_blocks], [*terminal, *tune_texts]
        eval_blocks, eval_texts = downstream_section(pretraining, out)  # `harness eval` scores
        blocks, terminal = [*blocks, *eval_blocks], [*terminal, *eval_texts]
    for title, note, table in write_tables(trials, out, order):
        blocks += [Heading(title), Paragraph(note), Table(table, flag="differs")]
        terminal.append(f"{title}\n{text_table(table)}")
    blocks += [Heading("Figures"), *_figures(trials, pretraining, steps, order, name, out, dirs[0])]
    blocks.append(Paragraph("All trials, all columns: `trials.csv`."))
    if sweep:
        blocks.append(Preformatted(yaml.safe_dump(sweep, sort_keys=False),
                                   RunsDir(dirs[0]).sweep_yaml.name))
    title = f"Sweep report: {name}"
    write_html(out / "report.html", title, blocks)
    atomic_write(out / "report.md", markdown_page(title, blocks))
    return "\n\n".join(terminal)


def _figures(trials: pd.DataFrame, pretraining: pd.DataFrame, steps: pd.DataFrame,
             order: Sequence[str], name: str, out: Path, runs_dir: Path) -> list[Block]:
    """Every trial's curve and memory; per method at its best LR: eval perplexity and training
    loss (95% bands over seeds), perplexity vs memory (Pareto frontier), tok/s; Optuna's."""
    figures = [("loss.png", curves_plot(steps, trials, name))] if len(trials) <= PER_TRIAL else []
    skipped = [] if figures else [Paragraph(
        f"loss.png, a curve per trial, is left out past {PER_TRIAL} trials ({len(trials)} here): "
        "eval.png and train_loss.png fold them per method setting.")]
    if not pretraining.empty:
        best = best_lr_trials(pretraining, order)
        figures += [("eval.png", eval_curves(steps, best, name)),
                    ("train_loss.png", loss_curves(steps, best, name)),
                    ("pareto.png", pareto_plot(best, name)),
                    ("throughput.png", throughput_chart(best, name))]
    figures.append(("memory.png", memory_chart(trials, name)))
    figures += [(f"optuna_{i}.png", fig) for i, fig in enumerate(optuna_figures(runs_dir))]
    return [*skipped, *(Image(out / file, save_png(*figure, out / file))
                        for file, figure in figures)]


def markdown_page(title: str, blocks: list[Block]) -> str:
    """The same page as report.html, for pasting into papers and wikis (images beside it)."""
    parts = [f"# {title}"]
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Table):
            parts.append(text_table(block.frame))
        elif isinstance(block, Image):
            parts.append(f"![{block.caption}]({Path(str(block.png)).name})")
        elif isinstance(block, Preformatted):
            parts.append(f"{block.caption}:\n\n```yaml\n{block.text}```")
    return "\n\n".join(parts) + "\n"


def best_lr_line(table: pd.DataFrame) -> str:
    """Say which LR won per method, so a reader need not scan the table."""
    picks = []
    for method, memory, precision, lr in table[[*VARIANT, "best lr"]].itertuples(index=False):
        picks.append(f"{variant_label(method, memory, precision)} {lr or 'n/a'}")
    return "Best LR per method: " + ", ".join(picks)


def _method_row(variant: dict[str, str], group: pd.DataFrame) -> dict[str, str]:
    """Best LR by mean eval ppl over seeds, among ok trials; blanks if none finished. Each
    metric shown is folded over that LR's seeds as the registry says (mean, max, ...)."""
    row = dict.fromkeys(SUMMARY_COLUMNS, "")
    row.update(variant, trials=_status_counts(group["status"]))
    folds = {m: (m, METRICS[m].across_seeds) for m in SHOWN if m != PICKED_BY and m in group}
    best = at_best_lr(group, PICKED_BY, minimize=METRICS[PICKED_BY].direction == "minimize",
                      **folds)
    if best is None:
        return row
    values = {**best[list(folds)], PICKED_BY: best["mean"]}  # a column a frame lacks: blank
    row["best lr"] = f"{best.name:g}"
    row.update({METRICS[m].header: metric_cell(m, values.get(m)) for m in SHOWN})
    return row


def _status_counts(status: pd.Series) -> str:
    """E.g. "1 ok / 3 (1 failed, 1 pending)": why a method has fewer results than planned."""
    counts = status.fillna("unknown").value_counts().sort_index()
    others = ", ".join(f"{n} {s}" for s, n in counts.items() if s != Status.OK)
    text = f"{int(counts.get(Status.OK, 0))} ok / {len(status)}"
    return f"{text} ({others})" if others else text


def _sweep_methods(sweep: dict[str, Any]) -> list[str]:
    methods = sweep.get("methods")
    return [str(label) for label in methods] if isinstance(methods, dict) else []
