"""What the summary table's numbers cannot say on their own, marked in the table and told in a
note under it:

- † a tok/s measured on a shared or loaded machine (another trial ran on the same host during
  its measured span, or the host's load average exceeded its cores): not comparable with a
  tok/s measured alone;
- ‡ a best learning rate at the edge of the LRs tried: the optimum may lie beyond it;
- § a method run outside its intended use (a fine-tuning method, such as QLoRA, pretraining
  from randomly initialised weights);
- ¶ a model whose shapes are not its preset's (model_options set the MLP width: GaLore's
  presets are the paper's shapes, so such a row is not the paper's setting).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.config import ModelOptions
from harness.errors import UserError
from harness.methods import get_memory, get_method
from harness.models import PRESETS, architecture
from harness.trials import Status

from .format import VARIANT_DEFAULTS, fill_variants, variant_label
from .stats import at_best_lr

SHARED, EDGE, OUTSIDE, RESHAPED = "†", "‡", "§", "¶"
WIDTH_KEYS = ("mlp_multiple_of", "intermediate_size")  # model_options that set the MLP width
TASKS = {"pretrain": "pretraining", "finetune": "fine-tuning"}  # Method.tasks, in words
VARIANT = list(VARIANT_DEFAULTS)


def numbers(trials: pd.DataFrame, column: str) -> pd.Series:
    if column not in trials:
        return pd.Series(np.nan, index=trials.index)
    return pd.to_numeric(trials[column], errors="coerce")


def measured_span(trials: pd.DataFrame) -> pd.DataFrame:
    """Each trial's wall-clock span of tok/s measurement (`start`, `end`, epoch seconds): the
    meter's own, else (runs from before it recorded one) from training's start to the trial's
    end. NaN where neither is known."""
    started = numbers(trials, "started_at")
    end = numbers(trials, "measured_to").fillna(started + numbers(trials, "wall_s"))
    start = numbers(trials, "measured_from").fillna(numbers(trials, "first_step_at"))
    return pd.DataFrame({"start": start.fillna(started), "end": end})


def with_conditions(trials: pd.DataFrame) -> pd.DataFrame:
    """`trials` with `concurrent_trials` (how many other trials' spans overlapped its own on
    the same host; NaN where its span is unknown) and `loaded` (its load average above the
    host's CPU count)."""
    span = measured_span(trials)
    host = trials["host"].fillna("") if "host" in trials else pd.Series("", index=trials.index)
    start, end = span["start"].to_numpy(), span["end"].to_numpy()
    overlap = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
    overlap &= host.to_numpy()[:, None] == host.to_numpy()[None, :]
    np.fill_diagonal(overlap, False)
    known = ~np.isnan(start) & ~np.isnan(end)
    count = np.where(known, overlap.sum(axis=1), np.nan)
    loaded = numbers(trials, "load_average") > numbers(trials, "cpu_count")
    return trials.assign(concurrent_trials=count, loaded=loaded.to_numpy())


def conditioned(trials: pd.DataFrame) -> pd.DataFrame:
    """`trials` with_conditions, unless they carry them (found among a larger set of trials)."""
    return trials if "concurrent_trials" in trials else with_conditions(trials)


def shared(trials: pd.DataFrame) -> pd.Series:
    """Whether each trial's tok/s was measured alongside another trial or on a loaded host."""
    trials = conditioned(trials)
    return (trials["concurrent_trials"].fillna(0) > 0) | trials["loaded"].fillna(False)


def conditions_line(trials: pd.DataFrame) -> str:
    """One sentence on where the finished trials' tok/s was measured."""
    ok = conditioned(trials)
    ok = ok[ok["status"] == Status.OK]
    known = ok["concurrent_trials"].notna()
    if not known.any():
        return "Throughput conditions: no finished trial records when it ran."
    together = ok["concurrent_trials"][known]
    most = int(together.max())
    text = (f"Throughput conditions: {int((together > 0).sum())} of {int(known.sum())} finished "
            f"trials ran while another trial ran on the same host (at most {most} other"
            f"{'s' if most > 1 else ''} at once)")
    loads = numbers(ok, "load_average").dropna()
    if len(loads):
        cores = numbers(ok, "cpu_count").dropna()
        on = f" on {int(cores.max())} cores" if len(cores) else ""
        text += f"; load average {loads.min():.1f}–{loads.max():.1f}{on}"
    return text + "."


def annotate(table: pd.DataFrame, trials: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The summary table (`report.summary_table` of `trials`) with its marks, and the note
    lines that explain them."""
    trials = conditioned(fill_variants(trials))
    marked = table.copy()
    edges: dict[str, list[str]] = {}  # where in its grid -> "label lr"
    crowds: dict[str, list[str]] = {}  # how the machine was shared -> labels
    outside: list[str] = []
    reshaped: dict[str, list[str]] = {}  # the widths used -> labels
    for i, row in table.iterrows():
        key = tuple(row[VARIANT])
        group = trials[(trials[VARIANT] == pd.Series(key, index=VARIANT)).all(axis=1)]
        label = variant_label(*key)
        if (why := outside_use(group)) is not None:
            marked.at[i, "method"] = f"{row['method']} {OUTSIDE}"
            outside.append(f"{OUTSIDE} {label}: {why}")
        if (widths := mlp_widths(group)) is not None:
            marked.at[i, "method"] = f"{marked.at[i, 'method']} {RESHAPED}"
            reshaped.setdefault(widths, []).append(label)
        best = at_best_lr(group, "eval_ppl")
        if best is None:
            continue
        if (edge := grid_edge(group, best.name)) is not None:
            marked.at[i, "best lr"] = f"{row['best lr']} {EDGE}"
            edges.setdefault(edge[0], []).append(f"{label} {best.name:g} (of {edge[1]})")
        at = group[(group["status"] == Status.OK) & (group["lr"] == best.name)]
        if row["tok/s"] and shared(at).any():
            marked.at[i, "tok/s"] = f"{row['tok/s']} {SHARED}"
            crowd, load = _how_shared(at)
            crowds.setdefault(crowd, []).append(label + load)
    lines = []
    if crowds:
        every = sum(map(len, crowds.values())) == len(table)
        lead = "Every tok/s here was measured" if every else "Measured"
        lines.append(f"{SHARED} {lead} on a shared or loaded machine, not comparable "
                     "with a tok/s measured alone (for throughput, run one trial at a time on "
                     f"an idle host): {_groups(crowds)}.")
    if edges:
        lines.append(f"{EDGE} Best LR at the edge of the LRs tried: the best may lie beyond "
                     f"it, widen the grid. {_groups(edges)}.")
    if reshaped:
        lines.append(f"{RESHAPED} Shapes not the preset's (at GaLore's sizes, not the paper's): "
                     f"model_options set the MLP width. {_groups(reshaped)}.")
    return marked, lines + outside


def mlp_widths(group: pd.DataFrame) -> str | None:
    """The MLP widths model_options gave a group's preset models where they are not the
    preset's own ("llama_1b MLP width 5504, not the preset's 5461"); None where every trial has
    its preset's shapes (or trials from before the option)."""
    widths = set()
    for _, trial in group.iterrows():
        options = {k: int(trial[f"model_options.{k}"]) for k in WIDTH_KEYS
                   if pd.notna(trial.get(f"model_options.{k}"))}
        model = trial.get("model")
        if options and model in PRESETS:
            width = architecture(model, ModelOptions(**options)).intermediate
            if width != PRESETS[model].intermediate:
                widths.add(f"{model} MLP width {width}, not the preset's "
                           f"{PRESETS[model].intermediate}")
    return "; ".join(sorted(widths)) or None


def _groups(groups: dict[str, list[str]]) -> str:
    return "; ".join(f"{why}: {', '.join(labels)}" for why, labels in groups.items())


def grid_edge(group: pd.DataFrame, best: float) -> tuple[str, str] | None:
    """Where `best` sits among the LRs the group tried (any status), and those LRs; None
    when inside them."""
    grid = sorted(set(pd.to_numeric(group["lr"], errors="coerce").dropna()))
    values = ", ".join(f"{v:g}" for v in grid)
    if len(grid) < 2:
        return "Only one LR tried (not tuned)", values
    if best == grid[0]:
        return "At the smallest tried (try lower)", values
    if best == grid[-1]:
        return "At the largest tried (try higher)", values
    return None


def outside_use(group: pd.DataFrame) -> str | None:
    """Why a fine-tuning-only method's pretraining rows say little about it, when its trials
    start from randomly initialised weights (a preset, not a pretrained model)."""
    names = group.get("method_name", pd.Series(dtype=object)).dropna()
    if names.empty or not group["model"].isin(list(PRESETS)).all():
        return None
    try:
        method = get_method(str(names.iloc[0]))
    except UserError:  # a method this version no longer has
        return None
    if "pretrain" in method.tasks:
        return None
    meant = " and ".join(TASKS.get(t, t) for t in method.tasks)
    adapter = get_memory(method.name).linears == "adapter"
    base = ", so the frozen base it adapts is random" if adapter else ""
    return (f"run outside its intended use (meant for {meant}): here it pretrains "
            f"{group['model'].iloc[0]} from randomly initialised weights{base}. "
            f"{method.tasks_note}.")


def _how_shared(at: pd.DataFrame) -> tuple[str, str]:
    """How the trials at a best LR shared their host ("while 1 other trial ran"), and the
    load average they saw (" (load average 2.9 on 2 cores)", or "")."""
    others = at["concurrent_trials"].max()
    crowd = (f"while {int(others)} other trial{'s' if others > 1 else ''} ran" if others > 0
             else "alone, on a loaded host")
    loads, cores = numbers(at, "load_average"), numbers(at, "cpu_count")
    if loads.isna().all():
        return crowd, ""
    on = f" on {int(cores.max())} cores" if cores.notna().any() else ""
    return crowd, f" (load average {loads.max():.1f}{on})"
