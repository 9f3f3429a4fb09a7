"""`harness bench loop`: the harness's loop against a bare PyTorch loop, side by side.

Both train the same preset from the same init on the same blocks, batch, precision and
step count; rounds alternate so drift in the machine hits both equally. Step 1 (allocator
warm-up, lazy init) is excluded from both, as the harness's reported tok/s excludes it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from harness.config import RunConfig
from harness.config.steps import lr_factor
from harness.data.c4 import BlockStream
from harness.data.loader import to_batch
from harness.distributed import pick_device
from harness.methods.resolve import load_run
from harness.train import Trainer
from harness.train.build import build_model
from harness.trials import Records

TARGET = 0.98


def bench_run(
    model: str, steps: int, batch_size: int, seq_len: int, precision: str, device: str
) -> RunConfig:
    return load_run(
        {
            "name": "bench",
            "model": model,
            "device": device,
            "task": {"seq_len": seq_len},
            "train": {
                "lr": 1e-3,
                "steps": steps,
                "batch_size": batch_size,
                "warmup_steps": 1,
                "precision": precision,
                "log_every": 10,
            },
            "eval": {"tokens": seq_len},
            "method": {"name": "full"},
        }
    )


def harness_tokens_per_s(run: RunConfig) -> float:
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, Records(Path(out), run), lambda step: False)
        try:
            trainer.fit()
            return trainer.meter.tokens_per_s or 0.0
        finally:
            trainer.close()


def bare_tokens_per_s(run: RunConfig) -> float:
    """The loop a user would write by hand: no records, no prefetch, data already in memory;
    bf16-true: the model cast to bfloat16, torch's fused AdamW on its weights."""
    t, device = run.train, pick_device(run.device)
    torch.manual_seed(run.seed)
    from harness.data.c4 import load_tokenizer

    tok = load_tokenizer(run.task.tokenizer)
    model = build_model(run.model, len(tok), run.task.seq_len, tok.pad_token_id,
                        run.model_options).to(device)
    if t.precision == "bf16-true":  # as a user writes it: the model in bf16, AdamW on it
        model = model.to(torch.bfloat16)
    stream = BlockStream(run.task, tok, run.seed)
    batches = [
        to_batch([stream.next_block() for _ in range(t.batch_size)], pin=False)
        for _ in range(t.steps)
    ]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=t.lr,
        weight_decay=t.weight_decay,
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t))
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if t.precision == "bf16-mixed"
        else nullcontext()
    )
    start = 0.0
    for step, (ids, labels) in enumerate(batches):
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (t.steps - 1) * t.batch_size * run.task.seq_len / (time.perf_counter() - start)


def bench_loop(run: RunConfig, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(rounds):
        ours = harness_tokens_per_s(run)
        bare = bare_tokens_per_s(run)
        rows.append(
            {"round": i + 1, "harness_tok_s": ours, "bare_tok_s": bare, "ratio": ours / bare}
        )
    return rows


def verdict(ratio: float, target: float, at_most: bool = False) -> str:
    """'met' or 'missed': a throughput ratio must reach its target, a time ratio (`at_most`)
    stay at or under it. The benchmark says it, so no reader has to compare columns."""
    return "met" if (ratio <= target if at_most else ratio >= target) else "missed"


def optim_verdict(record: dict[str, Any]) -> str:
    """A `bench optim` record's verdict against its `target` ('' without one): ours over
    galore-torch where that ratio exists, else the end-to-end step over AdamW's."""
    if record.get("target") is None:
        return ""
    ratio = record.get("ratio_to_galore_torch", record["ratio_to_adamw"])
    return verdict(ratio, record["target"], at_most=True)


def report(run: RunConfig, rows: list[dict[str, Any]], as_json: bool) -> str:
    ratio = statistics.median(r["ratio"] for r in rows)
    record = {
        "name": f"loop/{run.model}/{run.train.precision}/{pick_device(run.device).type}",
        "ratio": ratio,
        "target": TARGET,
        "verdict": verdict(ratio, TARGET),
        "rounds": rows,
    }
    if as_json:
        return json.dumps([record], indent=2)
    table = tabulate(
        [
            [
                r["round"],
                f"{r['harness_tok_s']:,.0f}",
                f"{r['bare_tok_s']:,.0f}",
                f"{r['ratio']:.3f}",
            ]
            for r in rows
        ],
        headers=["round", "harness tok/s", "bare tok/s", "ratio"],
    )
    return (f"{table}\n\n{record['name']}: median ratio {ratio:.3f}, target >= {TARGET}: "
            f"{record['verdict']}")


def optim_table(records: list[dict[str, Any]]) -> str:
    """ms per step and the ratios; `target` bounds the ratio it sits beside (at most), and
    `verdict` says whether it was met."""
    rows = []
    for r in records:
        versus = r.get("ratio_to_galore_torch")
        rows.append([r["name"], f"{r['ms_per_step']:.1f}", f"{r['ratio_to_adamw']:.3f}",
                     "" if versus is None else f"{versus:.3f}", r.get("target", ""),
                     optim_verdict(r)])
    return tabulate(rows, headers=["candidate", "ms/step", "vs AdamW", "vs galore-torch",
                                   "target", "verdict"])
