"""`harness bench` subcommands, one file each; `measure` runs the one asked for and renders its
records, so the command line only prints (JSON alone on stdout under --json)."""

from __future__ import annotations

import argparse
import json

from harness.errors import UserError


def measure(args: argparse.Namespace) -> str:
    """What `harness bench WHAT` prints: a table, or with --json the records as JSON."""
    import torch

    from harness.bench.loop import bench_loop, bench_run, optim_table, report

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "loop":
        run = bench_run(args.model, args.steps, args.batch_size, args.seq_len, args.precision,
                        args.device)
        return report(run, bench_loop(run, args.rounds), args.json)
    if args.what == "launch":
        from harness.bench.launch import bench_launch, launch_table

        records, table = bench_launch(args.rounds), launch_table
    elif args.what == "syncs":
        from harness.bench.syncs import bench_syncs, syncs_table

        records = bench_syncs(args.preset, args.steps, args.seq_len, args.batch_size)
        table = syncs_table
    elif args.what == "fsdp":
        from harness.bench.fsdp import bench_fsdp, fsdp_table

        records = bench_fsdp(args.model, args.steps, args.batch_size, args.seq_len, args.procs,
                             args.rounds, args.parallel)
        table = fsdp_table
    elif args.what == "memory":
        from harness.bench.memory import bench_memory, memory_table
        from harness.cost.profile import SKIPPED

        if args.steps <= SKIPPED:
            raise UserError(f"--steps {args.steps}: bench memory measures the peak of step "
                            f"{SKIPPED + 1}, after {SKIPPED} unmeasured; use --steps 3 or more")
        records = bench_memory(args.preset, args.steps, args.seq_len, args.batch_size)
        table = memory_table
    else:
        from harness.bench.optim import bench_optim

        records = bench_optim(args.preset, args.gap, args.steps, args.rank,
                              e2e_settings=tuple(args.e2e))
        table = optim_table
    return json.dumps(records, indent=2) if args.json else table(records)
