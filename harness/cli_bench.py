"""`harness bench`: its flags and its dispatch, apart from the other commands because it has
more of both than they do together."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cli_args import (
    EXIT_OK,
    Parser,
    logs_to_stderr,
    positive_float,
    positive_int,
    rank_and_micro,
)
from harness.errors import UserError


def counts(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: process counts, each at least 1, without repeats."""
    parts = text.split(",")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or len(set(parts)) < len(parts):
        raise argparse.ArgumentTypeError(f"expected process counts of at least 1, comma-"
                                         f"separated without repeats (e.g. 1,2,4), got '{text}'")
    return [int(p) for p in parts]


def strategies(text: str) -> list[str]:
    """'ddp,hsdp' -> ['ddp', 'hsdp'], each one `harness bench fsdp` runs."""
    from harness.bench.fsdp import PARALLEL

    parts = text.split(",")
    if not set(parts) <= set(PARALLEL) or len(set(parts)) < len(parts):
        raise argparse.ArgumentTypeError(f"expected strategies among {', '.join(PARALLEL)}, "
                                         f"comma-separated without repeats, got '{text}'")
    return parts


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "gpu":
        from harness.bench.gpu import bench_gpu

        if not args.out:
            raise UserError("bench gpu: --out DIR is required (the kit's gpu.json and gpu.md; "
                            "run again with the same DIR to go on with the parts left)")
        parts = args.parts.split(",") if args.parts else None
        text, status = bench_gpu(Path(args.out), args.budget_min, args.smoke, parts, args.cap_min)
        print(text)
        return status
    if args.what == "report":  # the analysis room's, beside bench's (the two do not import
        # each other)
        from harness.analysis.report_bench import bench_report, report_table

        records = bench_report(args.trials)
        print(json.dumps(records, indent=2) if args.json else report_table(records))
        return EXIT_OK
    from harness.bench import measure

    with logs_to_stderr(args.json):
        text = measure(args)
    print(text)
    return EXIT_OK


def add_bench(sub: Any, command: Callable[..., Parser]) -> None:
    """The `bench` subcommand on `sub`, made by the CLI's `command`."""
    b = command(sub, "bench", cmd_bench, "measure costs", "loop: the harness's training loop "
                "against a bare PyTorch loop (same model, data, batch, precision, steps), in "
                "alternating rounds. optim: the optimizer step alone on a preset's shapes, GaLore "
                "against AdamW and galore-torch (SVD amortised over the gap), plus GaLore's "
                "end-to-end step on llama_tiny (--e2e). memory: each method's weight, gradient, "
                "optimizer-state and extra bytes after --steps steps of --preset (default 20; 3 or "
                "more), against the estimator (target: equal), and the peak of step 3 (CUDA: of "
                "steps 3 on; target: within 5%). "
                "launch: the time from a trial's launch to its first training step, minus its "
                "model build, under each launcher that needs no cluster (--rounds trials each). "
                "syncs: reads of tensor values "
                "by the host (each a device sync on a GPU) per training step, per method and "
                "modifier, with where they are (target: none). gpu: every CUDA check in "
                "priority order within --budget-min, each part in its own process under its own "
                "cap, into --out's gpu.json and gpu.md; run again with the same --out to go on "
                "(docs/bench.md). fsdp: each rank's peak memory, the bytes it sends a step and the "
                "step time under train.parallel ddp, fsdp and hsdp (--parallel) at each of "
                "--procs process counts, --model, in --rounds alternating rounds. report: the "
                "time and peak memory of `harness report` on --trials synthetic finished "
                "trials (target: 2,000 in under 15 s)")
    b.add_argument("what", choices=["loop", "optim", "memory", "launch", "syncs", "gpu", "fsdp",
                                    "report"],
                   help="loop: harness vs bare loop; optim: optimizer step per method vs AdamW "
                   "and galore-torch; memory: estimator vs measured bytes per method; launch: "
                   "each launcher's per-trial overhead; syncs: host reads per training step; "
                   "gpu: the CUDA kit; fsdp: ddp, fsdp and hsdp peaks, bytes sent, step time; "
                   "report: a large sweep's report")
    b.add_argument("--model", default="llama_tiny", help="model preset (default llama_tiny)")
    b.add_argument("--steps", type=positive_int, default=20, help="steps per run (default 20)")
    b.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    b.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    b.add_argument("--precision", choices=["32-true", "bf16-mixed", "bf16-true", "fp32", "bf16"],
                   default="32-true", help="loop: 32-true, bf16-mixed or bf16-true (the bare "
                   "loop's model cast to bfloat16; old names: fp32, bf16)")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    b.add_argument("--rounds", type=positive_int, default=3,
                   help="alternating rounds (loop, fsdp); trials per launcher (launch)")
    b.add_argument("--procs", type=counts, default=[2], metavar="N,...",
                   help="fsdp: process counts, e.g. 1,2,4 (default 2)")
    b.add_argument("--parallel", type=strategies, metavar="NAME,...",
                   help="fsdp: strategies among ddp, fsdp, hsdp (default all three; hsdp as "
                   "two replica groups)")
    b.add_argument("--preset", default="llama_60m",
                   help="shapes for optim, memory and syncs (default llama_60m)")
    b.add_argument("--gap", type=positive_int, default=200, help="GaLore update_proj_gap (optim)")
    b.add_argument("--rank", type=positive_int, default=128, help="GaLore rank (optim)")
    b.add_argument("--e2e", type=rank_and_micro, action="append", default=[],
                   metavar="RANK:MICRO", help="optim: an end-to-end GaLore step at this rank "
                   "with MICRO micro-batches of 4x128 tokens per update (repeatable; default "
                   "--rank with one)")
    b.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    b.add_argument("--out", help="gpu: the folder of gpu.json and gpu.md (required)")
    b.add_argument("--budget-min", type=positive_float, default=25.0, metavar="MINUTES",
                   help="gpu: start a part only if its time cap fits in what is left (default 25)")
    b.add_argument("--parts", metavar="NAME,...",
                   help="gpu: only these parts, in the kit's order (default: all five)")
    b.add_argument("--cap-min", type=positive_float, metavar="MINUTES",
                   help="gpu: every part's time cap (default: each part's own, 4 to 8)")
    b.add_argument("--smoke", action="store_true",
                   help="gpu: the same parts on the CPU at llama_micro, in about a minute")
    b.add_argument("--trials", type=positive_int, default=2000,
                   help="report: finished trials in the synthetic sweep (default 2000)")
    b.add_argument("--json", action="store_true", help="print JSON records instead of a table")
