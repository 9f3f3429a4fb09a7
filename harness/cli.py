"""The `harness` command: train, sweep, status, report, estimate, methods, bench; each a thin
call into one room, and every user error one line (harness.errors)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cli_args import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USER,
    Parser,
    logs_to_stderr,
    positive_int,
)
from harness.cli_bench import add_bench
from harness.cli_sweep import cmd_sweep, load_trials
from harness.errors import UserError, render
from harness.eval import DEFAULT_TASKS, batch_size, task_list

# Only what building the parser needs is imported here: `harness --help` and `--version` stay
# light; each command imports its rooms (torch, transformers, pandas) when it runs.


def cmd_train(args: argparse.Namespace) -> int:
    from harness.config import parse_overrides, read_yaml
    from harness.cost.profile import SKIPPED
    from harness.distributed import pick_device
    from harness.methods.resolve import load_run
    from harness.sweep.launchers import follow_allocation, requeue_signals
    from harness.sweep.search.prune import pruner_for
    from harness.train import train
    from harness.trials import Status
    from harness.trials.writable import check_writable

    follow_allocation()
    run = load_run(read_yaml(args.config), parse_overrides(args.set))
    out = Path(args.out) if args.out else Path("runs") / run.name
    pick_device(run.device)  # before the run folder: a trial that cannot start is not written
    check_writable(out)
    steps = run.train.steps
    if args.profile and steps and args.profile + SKIPPED > steps:
        raise UserError(f"--profile {args.profile}: the run has {steps} steps and the profile "
                        f"needs {args.profile + SKIPPED} (the first {SKIPPED} are not recorded); "
                        "lower --profile or raise train.steps")
    summary = train(run, out, profile_steps=args.profile or 0, prune=pruner_for(out),
                    requeue=requeue_signals())
    status = summary["status"]
    print(f"{out}: {status}" + (f" ({summary['error']})" if summary.get("error") else ""))
    if status == Status.INTERRUPTED:
        print("stopped with a checkpoint; run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if status == Status.OK else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """With --watch, redraw every N seconds until every trial has finished (or Ctrl-C); with
    --json, print the rows once as records (analysis/status.py STATUS_KEYS)."""
    import time

    from harness.analysis.status import status_records, status_table
    from harness.trials import FINISHED

    while True:
        with logs_to_stderr(args.json):
            trials = load_trials(args.runs_dir)
        if args.json:
            print(status_records(trials))
            return EXIT_OK
        table = status_table(trials)
        if not args.watch:
            print(table)
            return EXIT_OK
        print(f"\033[2J\033[H{args.runs_dir}  {time.strftime('%H:%M:%S')}\n{table}", flush=True)
        if len(trials) and trials["status"].isin(FINISHED).all():
            return EXIT_OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from harness.analysis import write_report
    from harness.trials import RunsDir

    for runs_dir in args.runs_dirs:
        load_trials(runs_dir)
    out = Path(args.out) if args.out else RunsDir(args.runs_dirs[0]).report
    print(write_report(args.runs_dirs, out))
    print(f"\nreport written to {out} (report.html, report.md)")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from harness.config.metrics import human_bytes
    from harness.train.export import export_trial

    size = export_trial(Path(args.trial), Path(args.out))
    print(f"{args.out}: {human_bytes(size)} in Hugging Face format "
          "(transformers loads it with from_pretrained)")
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    from harness.eval.run import evaluate, result_lines

    scores = evaluate(Path(args.target), args.tasks, args.limit, args.batch_size, args.device,
                      say=print)
    print("\n".join(result_lines(scores)))
    print(f"scores written to eval.json in {len(scores)} trial folder(s)")
    return EXIT_OK


def cmd_dashboard(args: argparse.Namespace) -> int:
    from harness.sweep.search.dashboard import serve

    serve(Path(args.runs_dir), args.port)
    return EXIT_OK


def cmd_estimate(args: argparse.Namespace) -> int:
    from harness.config import parse_overrides
    from harness.cost.estimate import format_table, paper_comparison, to_json
    from harness.sweep.plan.expand import estimate_sweep, expand, load_sweep

    with logs_to_stderr(args.json):
        sweep = load_sweep(args.sweep, parse_overrides(args.set))
        records = estimate_sweep(sweep)
    if args.json:
        print(to_json(records))
        return EXIT_OK
    print(format_table(records, {t.id: (t.run.train.lr, t.point) for t in expand(sweep)}))
    comparison = paper_comparison(records, sweep)
    if comparison:
        print(f"\n{comparison}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from harness.analysis.load import check_runs_dir
    from harness.analysis.plan_view import format_plan, to_json
    from harness.cost.plan import parse_memory, plan

    if args.from_runs:
        try:
            check_runs_dir(Path(args.from_runs))
        except FileNotFoundError as e:
            raise UserError(f"--from: {e}") from None
    with logs_to_stderr(args.json):
        result = plan(args.model, parse_memory(args.memory), args.seq_len, args.token_batch,
                      args.tokenizer, gpus=args.gpus, nodes=args.nodes)
    print(to_json(result, args.model, args.from_runs) if args.json
          else format_plan(result, args.model, args.top, args.from_runs))
    return EXIT_OK


def type_name(annotation: object) -> str:
    if typing.get_args(annotation):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def cmd_methods(args: argparse.Namespace) -> int:
    from harness.methods import get_method, method_names
    from harness.methods.resolve import modifier_support

    for name in method_names():
        cls = get_method(name)
        print(f"{name}: {cls.summary}")
        for key, field in cls.Config.model_fields.items():
            kind = type_name(field.annotation)
            note = f"  - {field.description}" if field.description else ""
            default = field.get_default(call_default_factory=True)
            print(f"    {key}: {kind} = {default!r}{note}")
        tasks = {"pretrain": "pretraining", "finetune": "fine-tuning"}
        note = f" ({cls.tasks_note})" if cls.tasks_note else ""
        print(f"  meant for: {', '.join(tasks[t] for t in cls.tasks)}{note}")
        support = modifier_support(name)
        print(f"  modifiers: {', '.join(m for m, why in support.items() if why is None)}")
        for modifier, why in support.items():
            if why is not None:
                print(f"  refuses {modifier}: {why}")
    return EXIT_OK


VERBOSE_HELP = ("show internal event lines on the terminal: a trial's threads, ReLoRA's merges, "
                "Q-GaLore's SVDs, Optuna's study notices (they always go to the trial's log)")


def command(sub: Any, name: str, func: Callable, summary: str, description: str) -> Parser:
    parser = sub.add_parser(name, help=summary, description=description)
    parser.set_defaults(func=func)
    # after the command too (`harness sweep X --verbose`); SUPPRESS keeps the global one's value
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help=VERBOSE_HELP)
    return parser


def version() -> str:
    """The installed harness's version and torch's, read from package metadata (torch is not
    imported: `--version` stays instant)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        torch = f"torch {installed('torch')}"
    except PackageNotFoundError:
        torch = "torch not installed"
    return f"harness {installed('harness')} ({torch}, python {platform.python_version()})"


def build_parser() -> Parser:
    p = Parser(prog="harness", description="Compare memory-efficient LLM training methods on "
               "equal model, data and token budget.")
    p.add_argument("--version", action="version", version=version())
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    sets = {"action": "append", "default": [], "metavar": "KEY=VALUE",
            "help": "override a dotted config key, e.g. --set train.steps=20 (repeatable)"}
    runs_dir = "a sweep's run directory, e.g. runs/quickstart"

    t = command(sub, "train", cmd_train, "run one training run",
                "Run (or resume) one training run from a run config.")
    t.add_argument("config", help="run config YAML")
    t.add_argument("--set", **sets)
    t.add_argument("--out", help="run folder (default runs/<name>); resumes from its checkpoint")
    t.add_argument("--profile", type=positive_int, metavar="STEPS", help="record a torch.profiler "
                   "trace of STEPS steps (after 2 unrecorded) in OUT/profile: trace.json and "
                   "ops.txt, the operators by self time; the run's tok/s then includes the "
                   "profiler's cost")

    s = command(sub, "sweep", cmd_sweep, "run a sweep of trials", "Expand a sweep into trials "
                "(methods x search space x seeds) and run those not yet finished.")
    s.add_argument("sweep", help="sweep YAML, e.g. sweeps/quickstart.yaml")
    s.add_argument("--set", **sets)
    s.add_argument("--out", help="run directory (default runs/<sweep name>)")
    s.add_argument("--jobs", type=positive_int, help="trials run at once (default launcher.jobs)")
    s.add_argument("--dry-run", action="store_true", help="print the trial plan, run nothing")
    s.add_argument("--retry-failed", action="store_true",
                   help="also re-run trials that ended failed, oom, nan or killed")

    st = command(sub, "status", cmd_status, "one row per trial", "Show every trial's status, "
                 "step, eval perplexity, tok/s and peak memory.")
    st.add_argument("runs_dir", help=runs_dir)
    once = st.add_mutually_exclusive_group()
    once.add_argument("--watch", type=positive_int, nargs="?", const=5, metavar="SECONDS",
                      help="redraw every SECONDS (default 5) until every trial has finished")
    once.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    r = command(sub, "report", cmd_report, "write tables and plots", "Write the report of one "
                "or more runs directories (report.html with everything embedded, report.md, "
                "the tables as csv and md, the plots as png) and print the tables.")
    r.add_argument("runs_dirs", nargs="+", metavar="RUNS_DIR", help=runs_dir)
    r.add_argument("--out", help="report folder (default: the first RUNS_DIR/report)")
    x = command(sub, "export", cmd_export, "a trial's model in Hugging Face format", "Write "
                "a trial's model as transformers loads it: its final model, or (an unfinished "
                "trial, or one kept without) the model of its newest checkpoint, exported by "
                "its method (adapters merged, INT8 and NF4 weights dequantized, W = BA).")
    x.add_argument("trial", help="a trial folder, e.g. runs/quickstart/trials/full-3e75ede2 "
                   "(a trial's id is its method and a hash of its config; `harness status "
                   "RUNS_DIR` lists them)")
    x.add_argument("--out", required=True, help="folder to write the model into")
    ev = command(sub, "eval", cmd_eval, "downstream scores with lm-eval", "Score a trial's "
                 "final model, or every finished trial's of a runs directory, with "
                 "lm-evaluation-harness; each task's scores go into the trial's eval.json.")
    ev.add_argument("target", metavar="TRIAL_OR_RUNS", help="a trial folder or " + runs_dir)
    ev.add_argument("--tasks", type=task_list, default=list(DEFAULT_TASKS), help="lm-eval "
                    f"task names, comma-separated (default {','.join(DEFAULT_TASKS)}; offline: "
                    "c4_sample_choice)")
    ev.add_argument("--limit", type=positive_int, help="score the first N examples of each task")
    ev.add_argument("--batch-size", type=batch_size, default=8,
                    help="sequences a forward pass (default 8; auto: the largest that fits)")
    ev.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda where there is one)")
    d = command(sub, "dashboard", cmd_dashboard, "watch a search sweep's studies",
                "optuna-dashboard on the sweep's own study storage, on 127.0.0.1.")
    d.add_argument("runs_dir", help=runs_dir)
    d.add_argument("--port", type=positive_int, default=8080, help="default 8080")

    add_bench(sub, command)

    e = command(sub, "estimate", cmd_estimate, "predict each trial's memory", "Predict each "
                "trial's weight, gradient, optimizer-state and extra bytes from the model's shapes "
                "alone (nothing allocated, no data read), and its peak with activations; on "
                "GaLore's presets, compare with the paper's Table 2.")
    e.add_argument("sweep", help="sweep YAML, e.g. sweeps/c4_1b.yaml")
    e.add_argument("--set", **sets)
    e.add_argument("--json", action="store_true", help="print JSON records instead of a table")

    pl = command(sub, "plan", cmd_plan, "what fits in a memory budget", "Every method x "
                 "memory modifier x precision x micro-batch whose estimated peak (as `harness "
                 "estimate` predicts it) fits the budget, fastest first by a relative compute "
                 "cost; if nothing fits, the closest.")
    pl.add_argument("model", help="model preset, e.g. llama_7b, or a Hugging Face config "
                    "folder (docs/data.md)")
    pl.add_argument("--memory", required=True, help="the device's memory: 24GB, 24 GB, 24GiB, "
                    "16000MB (GB = 1e9 bytes, GiB = 2^30)")
    pl.add_argument("--seq-len", type=positive_int, default=256, help="tokens a sequence")
    pl.add_argument("--token-batch", type=positive_int, default=256,
                    help="tokens a GPU takes each optimizer step (default 256: the GaLore "
                    "paper's 7B setting)")
    pl.add_argument("--gpus", type=positive_int, default=1,
                    help="GPUs the model is sharded over (train.parallel: fsdp), each of "
                    "--memory; default 1")
    pl.add_argument("--nodes", type=positive_int, default=1,
                    help="nodes the --gpus are on, equally: more than 1 shards within a node "
                    "and replicates across nodes (train.parallel: hsdp); default 1")
    pl.add_argument("--tokenizer", default="t5-base", help="its vocabulary sizes the embedding "
                    "(default t5-base, the papers')")
    pl.add_argument("--from", dest="from_runs", metavar="RUNS_DIR",
                    help="order each method's fastest fit by the eval perplexity its trials "
                    "reached in this runs folder (default: the published perplexities)")
    pl.add_argument("--top", type=int, default=20, help="rows printed (0: all; default 20)")
    pl.add_argument("--json", action="store_true", help="print JSON records instead of a table")

    command(sub, "methods", cmd_methods, "list the registered methods", "Each method, its "
            "hyperparameters with types and defaults, and what it is.")
    return p


def quiet_libraries() -> None:
    """Hub retry warnings and optional-kernel notices, not actionable offline, stay off stderr."""
    for var in ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY", "HF_HUB_VERBOSITY"):
        os.environ.setdefault(var, "error")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    from harness.trials.events import set_verbose, verbose  # torch: every command needs it

    set_verbose(args.verbose or verbose())
    try:
        return args.func(args)
    except UserError as e:
        print(render(e), file=sys.stderr)
        return EXIT_USER
    except BrokenPipeError:  # `harness ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
