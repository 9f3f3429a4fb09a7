"""`harness plan`'s printout: the configurations that fit, fastest first, then each method's
fastest fit ordered by perplexity, so the answer is a frontier of quality and cost, not a speed
list.

The perplexities are measured, with `--from RUNS_DIR`: each method's best seed-mean final eval
perplexity over the learning rates it ran there (a smaller-scale sweep such as repro_small), or
published: the 60M-1B tables run in GaLore's setup (GaLore Table 2, APOLLO Table 2, Fira Table
3, Q-GaLore Table 1; one recipe, one full-rank baseline) at the plan's model size, or the
nearest they have (LLaMA-7B: 1B, where every one of them has a row; smaller presets: 60M).
Methods without a figure come after, by cost. A method is on the frontier when no other is
both at least as good in perplexity and as cheap, and better in one.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pandas as pd
from tabulate import tabulate

from harness.config.metrics import human_bytes
from harness.cost.plan import Candidate, Plan
from harness.trials import Status

from .load import PathArg, load_runs
from .paper import PAPER_ROWS, SIZES, paper_key
from .recipe import load_paper
from .stats import best_lr

GALORE_SETUP = ("galore_table2", "apollo_table2", "fira_table3", "qgalore_table1")
SETUP_SIZES = ("60M", "130M", "350M", "1B")
# A method whose perplexity is this much above full-rank AdamW's is a poor pick however fast:
# in GaLore's setup the methods published as matching full rank (GaLore, Q-GaLore, APOLLO,
# Fira) stay within 6% of it at every size; ReLoRA, LoRA and low-rank are 18% to 9x above it
# at 1B.
POOR_QUALITY = 1.10


def published(model: str) -> tuple[dict[str, float], str]:
    """Perplexities published in GaLore's setup at the model's size or the nearest one."""
    size = SIZES.get(model, "60M")
    size = size if size in SETUP_SIZES else SETUP_SIZES[-1]  # 7B: the largest they share
    by_name = {name: key for key, names in PAPER_ROWS.items() for name in names}
    found: dict[str, float] = {}
    for table in GALORE_SETUP:
        rows = load_paper(table)
        for name, ppl in rows.loc[rows["model"] == size, ["method", "perplexity"]].itertuples(
                index=False):
            if name in by_name:
                found.setdefault(by_name[name], float(ppl))
    return found, (f"perplexity published at {size} in GaLore's setup (GaLore Table 2, APOLLO "
                   "Table 2, Fira Table 3, Q-GaLore Table 1)")


def measured(runs_dir: PathArg) -> tuple[dict[str, float], str]:
    """Each method's best seed-mean final eval perplexity over its learning rates."""
    trials = load_runs(runs_dir)
    ok = trials[(trials["status"] == Status.OK) & trials["eval_ppl"].notna()]
    if ok.empty:
        return {}, f"no finished trial with an eval perplexity in {runs_dir}"
    optimizer = ok["method.optimizer"] if "method.optimizer" in ok else pd.Series(None, ok.index)
    keys = [paper_key(m, o) or m for m, o in zip(ok["method_name"], optimizer, strict=True)]
    picks = best_lr(ok.assign(key=keys), ["key"])
    models = ", ".join(sorted(map(str, ok["model"].dropna().unique())))
    return ({str(k): float(v) for k, v in zip(picks["key"], picks["mean"], strict=True)},
            f"eval perplexity measured in {runs_dir} ({models}; best LR, seed mean)")


def perplexities(model: str, runs_dir: PathArg | None) -> tuple[dict[str, float], str]:
    """The perplexities that order the methods, and where they come from."""
    return measured(runs_dir) if runs_dir else published(model)


def by_quality(p: Plan, quality: dict[str, float]) -> list[dict[str, Any]]:
    """Each method's fastest configuration that fits, best perplexity first, frontier marked."""
    rows = [{"method": c.label, "perplexity": quality.get(_key(c)), "candidate": c}
            for c in _fastest_per_method(p.fits)]
    rated = sorted((r for r in rows if r["perplexity"] is not None),
                   key=lambda r: (r["perplexity"], r["candidate"].cost))
    unrated = [r for r in rows if r["perplexity"] is None]
    for r in rated:
        r["frontier"] = not any(
            o["perplexity"] <= r["perplexity"] and o["candidate"].cost <= r["candidate"].cost
            and (o["perplexity"], o["candidate"].cost) != (r["perplexity"], r["candidate"].cost)
            for o in rated)
    return rated + [{**r, "frontier": False} for r in unrated]


def quality_note(p: Plan, quality: dict[str, float]) -> str | None:
    """When the fastest fit's method has a perplexity more than POOR_QUALITY times full-rank
    AdamW's (or, without a full-rank figure, the best fit's): say so, and name the fit with
    the best perplexity and its row."""
    if not p.fits or _key(p.fits[0]) not in quality:
        return None
    first, ranked = p.fits[0], [r for r in by_quality(p, quality) if r["perplexity"]]
    mine, best = quality[_key(first)], ranked[0]
    reference, name = (quality["full"], "full-rank AdamW's") if "full" in quality else (
        best["perplexity"], f"{best['method']}'s")
    if mine <= POOR_QUALITY * reference or best["method"] == first.label:
        return None
    row = p.fits.index(best["candidate"]) + 1
    return (f"note: the fastest fit, {first.label}, reaches perplexity {mine:.2f} against {name} "
            f"{reference:.2f} (source in the list below): a poor pick despite its speed; the "
            f"best perplexity that fits is {best['method']}'s, {best['perplexity']:.2f} "
            f"(row {row})")


def _key(c: Candidate) -> str:
    return paper_key(c.method, c.settings.get("optimizer")) or c.method


def _fastest_per_method(fits: list[Candidate]) -> list[Candidate]:
    """Each entry's fastest row (bf16-mixed with no modifier, the papers' usual setting, where
    that is as fast)."""
    best: dict[str, Candidate] = {}
    usual = sorted(fits, key=lambda c: (round(c.cost, 4), c.precision != "bf16-mixed",
                                        bool(c.modifiers)))
    for c in usual:
        best.setdefault(c.label, c)
    return list(best.values())


def _extra(c: Candidate) -> str:
    parts = []
    if c.recompute_forwards:
        parts.append(f"+{c.recompute_forwards:.2f} forward")
    if c.transfer_bytes:
        parts.append(f"{human_bytes(c.transfer_bytes)} host transfers")
    if c.accumulation > 1:
        parts.append(f"{c.accumulation} micro-batches")
    return ", ".join(parts) or "none"


def _settings(rows: list[Candidate]) -> str:
    """The settings the planner chose, once: each distinct one with the methods it applies to."""
    chosen: dict[str, list[str]] = {}
    for c in rows:
        for key, value in c.settings.items():
            chosen.setdefault(f"{key}={value}", []).append(c.label)
    return "; ".join(f"{k} ({', '.join(dict.fromkeys(labels))})" for k, labels in chosen.items())


def format_plan(p: Plan, model: str, top: int = 20, runs_dir: PathArg | None = None) -> str:
    """The table, fastest first, and each method's fastest fit by perplexity: measured in
    `runs_dir`, or published."""
    ppl, source = perplexities(model, runs_dir)
    headers = ["#", "method", "modifiers", "precision", "micro x accum", "peak",
               "cost", "extra compute", "tok/s"]  # fmt: skip
    rows = p.fits or p.closest
    shown = rows[:top] if top > 0 else rows

    def row(i: int, c: Candidate) -> list[str]:
        tok = f"{c.tok_s:,.0f} ({c.tok_s_source})" if c.tok_s else "—"
        return [str(i), c.label, c.modifiers or "none", c.precision,
                f"{c.micro_batch} x {c.accumulation}", human_bytes(c.peak_bytes),
                f"x{c.cost:.2f}", _extra(c), tok]  # fmt: skip

    table = tabulate([row(i, c) for i, c in enumerate(shown, 1)], headers=headers,
                     disable_numparse=True)
    budget = human_bytes(p.budget)
    if p.nodes > 1:
        budget += (f" a GPU, sharded over each node's {p.gpus // p.nodes} GPUs, {p.nodes} nodes "
                   "replicating each other (train.parallel: hsdp)")
    elif p.gpus > 1:
        budget += f" a GPU, sharded over {p.gpus} GPUs (train.parallel: fsdp)"
    if not p.fits:
        head = f"nothing fits {model} in {budget}; the {len(shown)} closest by peak:"
    else:
        head = f"{len(p.fits)} configurations of {model} fit in {budget}, fastest first:"
    more = len(rows) - len(shown)
    tail = f"\n... {more} more (--top 0 for all, --json for records)" if more else ""
    settings = _settings(shown)
    tail += f"\nsettings: {settings}" if settings else ""
    note = ("\ncost: step time relative to full AdamW, bf16-mixed, no modifier, one micro-batch "
            f"(compute model in docs/estimate.md); {len(p.refused)} combinations refused")
    warning = quality_note(p, ppl)
    table += f"\n{textwrap.fill(warning, 100, subsequent_indent='  ')}" if warning else ""
    return f"{head}\n{table}{tail}{note}{_per_method(p, ppl, source)}"


def _per_method(p: Plan, quality: dict[str, float], source: str) -> str:
    """Each method entry's fastest row that fits, best perplexity first; then the entries
    refused in every setting and those not meant for pretraining: which baselines a budget
    holds, and which of them is worth it, whatever the top rows are."""
    lines = []
    for r in by_quality(p, quality):
        c, ppl = r["candidate"], r["perplexity"]
        rated = f", perplexity {ppl:.2f}{' (frontier)' if r['frontier'] else ''}" if ppl else ""
        lines.append(f"  {c.label}: {c.precision}, {c.modifiers or 'no modifier'}, "
                     f"{c.micro_batch} x {c.accumulation}, {human_bytes(c.peak_bytes)}, "
                     f"x{c.cost:.2f}{rated or ', no perplexity'}")
    lines += [f"  {label}: refused ({why})" for label, why in sorted(p.unusable.items())]
    text = (f"\neach method's fastest that fits, best perplexity first ({source}):\n"
            + "\n".join(lines) if lines else "")
    if p.apart:
        text += "\nnot for pretraining from scratch, listed apart:\n" + "\n".join(
            f"  {label}: {why}" for label, why in sorted(p.apart.items()))
    return text


def to_json(p: Plan, model: str, runs_dir: PathArg | None = None) -> str:
    ppl, source = perplexities(model, runs_dir)
    ranked = [{"method": r["method"], "perplexity": r["perplexity"], "frontier": r["frontier"],
               "config": r["candidate"].record()} for r in by_quality(p, ppl)]
    return json.dumps({"budget_bytes": p.budget, "gpus": p.gpus, "nodes": p.nodes,
                       "unusable": p.unusable,
                       "apart": p.apart, "fits": [c.record() for c in p.fits],
                       "closest": [c.record() for c in p.closest], "refused": p.refused,
                       "by_quality": ranked, "quality_source": source,
                       "quality_note": quality_note(p, ppl)},
                      indent=2)  # fmt: skip
