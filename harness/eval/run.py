"""`harness eval`: lm-evaluation-harness on trials' final models, through its Python API
(`lm_eval.simple_evaluate` on an `HFLM` wrapping the model and tokenizer loaded from the
trial's `model/`), each task's scores merged into the trial's `eval.json` (store.py).

A task whose data cannot be had (the hub unreachable and the data set not in the local
cache) is one line naming it, and the others go on; one lm-eval does not know stops the
command before any model is loaded.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from harness.config.hub import offline
from harness.errors import UserError, brief
from harness.eval.sample_task import NAME as SAMPLE_TASK
from harness.eval.sample_task import TASKS
from harness.eval.store import merge_scores
from harness.eval.targets import Say, model_step, targets
from harness.trials import TrialDir

OURS = (SAMPLE_TASK,)  # the tasks shipped in harness/eval/tasks
INSTALL = "pip install -e '.[eval]' (lm-eval 0.4.13)"
BatchSize = int | str  # a count, or "auto": lm-eval finds the largest that fits


def lm_eval_module() -> Any:
    """lm_eval, imported on use: an optional dependency (pyproject's `eval` extra)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"harness eval needs lm-evaluation-harness, which is not installed: "
                        f"{INSTALL}")
    import lm_eval

    return lm_eval


@lru_cache(maxsize=2)
def _manager(defaults: bool) -> Any:
    """Ours, with lm-eval's (`defaults`): its index reads every task file lm-eval ships, so it
    is built once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=defaults)


def task_manager(names: Sequence[str]) -> Any:
    """lm-eval's tasks and ours (only ours when only ours are asked). UserError naming a task
    it does not know, before anything runs."""
    manager = _manager(not set(names) <= set(OURS))
    for name in names:
        if name not in manager.all_tasks:
            raise UserError(f"--tasks: no task '{name}' (`lm-eval ls tasks` lists "
                            f"lm-eval's; this harness adds {', '.join(OURS)})")
    return manager


@contextmanager
def hub_as_it_is() -> Iterator[None]:
    """When the hub cannot be reached, datasets reads its cache alone (at once, where it would
    otherwise retry each data set for tens of seconds); restored after."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if offline():
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def available(manager: Any, names: Sequence[str], say: Say) -> list[str]:
    """The tasks whose data can be had, each other one line naming it."""
    found = []
    for name in names:
        try:
            manager.load([name])
            found.append(name)
        except OSError as e:  # datasets' ConnectionError and DatasetNotFoundError among them
            say(f"{name}: skipped, its data cannot be had ({brief(e)})")
    return found


def load_model(folder: Path, device: str) -> tuple[Any, Any]:
    """The final model (in the dtype it was saved in) and its tokenizer, for HFLM. Attention
    is transformers' sdpa with the padding mask lm-eval's batches need."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", attn_implementation="sdpa")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


def entries(results: dict[str, Any], limit: int | None, step: int | None,
            version: str) -> dict[str, dict[str, Any]]:
    """One eval.json entry per task of lm-eval's results: metric and stderr by name (a filter
    other than `none` kept in the name), the examples scored, the task's version."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = {}
    for task, values in results["results"].items():
        metrics: dict[str, Any] = {}
        stderr: dict[str, Any] = {}
        for key, value in values.items():
            if "," not in key:  # alias, name
                continue
            metric, filt = key.split(",", 1)
            into, metric = ((stderr, metric.removesuffix("_stderr"))
                            if metric.endswith("_stderr") else (metrics, metric))
            into[metric if filt == "none" else f"{metric},{filt}"] = (
                value if isinstance(value, (int, float)) else None)  # a group's "N/A"
        n = results.get("n-samples", {}).get(task, {})
        out[task] = {"metrics": metrics, "stderr": stderr, "n": n.get("effective"),
                     "n_total": n.get("original"), "version": results["versions"].get(task),
                     "num_fewshot": results.get("n-shot", {}).get(task), "limit": limit,
                     "lm_eval": version, "model_step": step, "evaluated_at": at}
    return out


def score(trial: TrialDir, names: Sequence[str], manager: Any, limit: int | None,
          batch_size: BatchSize, device: str) -> dict[str, dict[str, Any]]:
    """lm-eval's scores of the trial's final model on `names`, merged into its eval.json;
    the entries written."""
    lm_eval = lm_eval_module()
    from lm_eval.models.huggingface import HFLM

    model, tok = load_model(trial.final_model, device)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=manager,
                                      limit=limit, log_samples=False)
    written = entries(results, limit, model_step(trial), lm_eval.__version__)
    merge_scores(trial, written)
    return written


def device_of(name: str | None) -> str:
    """`--device`, checked: default CUDA where there is one, else the CPU."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(name).type
    except RuntimeError:
        raise UserError(f"--device {name}: not a device (allowed: cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is visible (allowed here: cpu)")
    return name


def evaluate(path: Path, names: Sequence[str], limit: int | None, batch_size: BatchSize,
             device: str | None, say: Say) -> dict[str, dict[str, dict[str, Any]]]:
    """`harness eval PATH`: every target's scores on the tasks whose data can be had; per
    trial folder, the entries written. UserError when none of the tasks can be run."""
    lm_eval_module()
    device = device_of(device)
    manager = task_manager(names)
    found = targets(path, say)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notices on a model object
    with hub_as_it_is():
        runnable = available(manager, names, say)
        if not runnable:
            raise UserError(f"--tasks: the data of none of {', '.join(names)} can be had; "
                            f"{SAMPLE_TASK} runs offline")
        return {str(trial): score(trial, runnable, manager, limit, batch_size, device)
                for trial in found}


def result_lines(scores: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """A line per trial and task: each metric with its standard error, the examples scored."""
    lines = []
    for trial, tasks in scores.items():
        for task, entry in tasks.items():
            cells = [f"{name} {value:.4f}" + (f" ± {entry['stderr'][name]:.4f}"
                                              if entry["stderr"].get(name) is not None else "")
                     for name, value in entry["metrics"].items() if value is not None]
            n = f" ({entry['n']} of {entry['n_total']} examples)" if entry["n"] else ""
            lines.append(f"{trial}: {task}: {', '.join(cells)}{n}")
    return lines
