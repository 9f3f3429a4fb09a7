"""The parts of `harness bench gpu`, each run in its own process by harness/bench/gpu.py.

`python -m harness.bench.gpu_parts PART OUT [--smoke]` measures one part and appends each record
to OUT/PART.jsonl as soon as it has it, so a part stopped at its time cap keeps what it measured.
`--smoke` runs the same code on the CPU at llama_micro with tiny settings (CI's check that the
kit has not rotted); the figures are then not GPU figures and say so (`device`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

from harness.bench.loop import TARGET, bench_loop, bench_run, verdict
from harness.bench.memory import METHODS, free_memory, measure_run, method_records
from harness.cost.estimate import estimate_run, vocab_size
from harness.cost.meter import peak_flops
from harness.cost.paper_7b import PAPER_7B
from harness.methods.resolve import load_run
from harness.models import param_shapes

Record = dict[str, Any]
MFU_TARGET = 0.40  # full AdamW at its best micro-batch on an H100 (issue 26)
PAPER_TOKENIZER = "t5-base"  # the papers' vocabulary (32,100), for the estimate beside them


@dataclass(frozen=True)
class Settings:
    """Sizes for one mode: the GPU measurement, or the CPU smoke run of the same code."""

    device: str
    presets: tuple[str, ...]  # estimate vs max_memory_allocated
    steps: int
    seq_len: int
    batch_size: int
    table11: str  # GaLore Table 11's model
    table11_rows: tuple[str, ...] | None  # TABLE11's labels to run (None: all)
    rank_1b: int
    mfu_batches: tuple[int, ...]
    mfu_compile: bool  # also the best micro-batch under train.compile
    gemm_s: float  # the least time each matmul of the GEMM probe is timed for
    loop: tuple[str, int, int, int, str, int]  # model, steps, batch, seq_len, precision, rounds
    big: str  # the 7B single-step part's model
    rank_7b: int


# MFU micro-batches: 16, where the curve flattens (docs/benchmarks.md), 64, the best so far,
# and 128, which says whether a larger one helps.
GPU = Settings("cuda", ("llama_60m", "llama_350m"), 6, 256, 8, "llama_1b", None, 512,
               (16, 64, 128), True, 0.5, ("llama_350m", 30, 8, 256, "bf16-mixed", 3),
               "llama_7b", 1024)
# The smoke run: every method in `estimate`, two of Table 11's rows (the same loop), small
# enough for CI's CPUs. No compiled run: inductor's C++ build of llama_micro alone would be
# much of its time (train.compile has its own test,
# tests/train/test_train.py); it is the same `_run` and `_measured` as every other row.
SMOKE = Settings("cpu", ("llama_micro",), 3, 32, 2, "llama_micro",
                 ("full", "galore_8bit_layerwise"), 8, (1, 2), False, 0.01,
                 ("llama_micro", 3, 2, 32, "32-true", 1), "llama_micro", 8)


def _run(s: Settings, model: str, method: dict[str, Any], layerwise: bool = False,
         batch_size: int = 1, steps: int = 3, **train: Any) -> Any:
    """A short pretraining run at the papers' token batch (batch_size × 256 on a GPU)."""
    return load_run({
        "name": "gpu", "model": model, "device": s.device, "method": method,
        "task": {"seq_len": 256 if s.device == "cuda" else s.seq_len},
        "train": {"steps": steps, "batch_size": batch_size, "log_every": steps, **train},
        "eval": {"tokens": 256}, "memory": {"layerwise": layerwise},
    })  # fmt: skip


def _measured(run: Any) -> Record:
    """Peak of the steady steps, tok/s and MFU of one run; `oom` when it does not fit."""
    try:
        results, peak = measure_run(run)
        return {"status": "ok", "peak_bytes": peak, "tokens_per_s": results["tokens_per_s"],
                "mfu": results["mfu"]}
    except torch.OutOfMemoryError as e:  # the next measure_run frees what this one left
        return {"status": "oom", "error": str(e).splitlines()[0]}


def tests(s: Settings, out: Path) -> Iterator[Record]:
    """`pytest -m gpu` (tests/gpu): the method × modifier × precision matrix on the device."""
    tests_dir = Path.cwd() / "tests" / "gpu"  # the checkout's: an installed kit has no tests
    if not tests_dir.is_dir():
        raise SystemExit(f"no {tests_dir}: run the kit from the repository's root")
    report = out / "gpu-tests.xml"
    path = os.pathsep.join(filter(None, [str(tests_dir), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path,  # each outcome as it comes (gpu_outcomes.py):
           "HARNESS_GPU_RECORDS": str(out / "tests.jsonl"),  # pytest's report dies with a cap
           **({"HARNESS_GPU_SMOKE": "1"} if s.device == "cpu" else {})}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", str(tests_dir), "-q",
                           "-n0", "-p", "no:cacheprovider", "-p", "gpu_outcomes",
                           f"--junitxml={report}"],
                          env=env, capture_output=True, text=True)
    yield _junit(report, done.returncode, done.stdout[-2000:])
    report.unlink(missing_ok=True)


def _junit(report: Path, returncode: int, tail: str) -> Record:
    if not report.exists():
        return {"name": "gpu/tests", "status": "failed", "error": tail}
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failures = [f"{case.get('classname')}::{case.get('name')}: "
                f"{(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}"
                for case in suite.iter("testcase")
                for bad in case if bad.tag in ("failure", "error")]  # fmt: skip
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    passed = total - skipped - len(failures)
    return {"name": "gpu/tests", "value": passed, "failed": len(failures), "skipped": skipped,
            "failures": failures, "met": returncode == 0 and not failures and passed > 0}


def estimate(s: Settings, out: Path) -> Iterator[Record]:
    """Every method's counted bytes (exact) and steady-step peak (±5%) against the estimate."""
    for preset in s.presets:
        for label in METHODS:
            try:
                records = method_records(label, preset, s.steps, s.seq_len, s.batch_size)
            except torch.OutOfMemoryError as e:
                records = [{"name": f"memory/{preset}/{label}", "status": "oom",
                            "error": str(e).splitlines()[0]}]
            for r in records:
                yield {**r, "name": f"gpu/{r['name']}"}


TABLE11 = {  # label -> (method, layer-wise, paper row in analysis/paper/galore_table11.csv)
    "full": ({"name": "full"}, False, "AdamW"),
    "full_layerwise": ({"name": "full"}, True, "AdamW"),
    "adam8bit": ({"name": "adam8bit"}, False, "Adam8bit"),
    "adam8bit_layerwise": ({"name": "adam8bit"}, True, "Adam8bit"),
    "galore": ({"name": "galore"}, False, None),
    "galore_layerwise": ({"name": "galore"}, True, None),
    "galore_8bit": ({"name": "galore", "optimizer": "adam8bit"}, False, "8-bit GaLore"),
    "galore_8bit_layerwise": ({"name": "galore", "optimizer": "adam8bit"}, True, "8-bit GaLore"),
}


def _paper_table11() -> dict[tuple[str, bool], tuple[float, float]]:
    text = resources.files("harness.analysis").joinpath("paper/galore_table11.csv").read_text()
    return {(r["method"], r["layerwise"] == "true"): (float(r["memory_gb"]),
                                                       float(r["tokens_per_s"]))
            for r in csv.DictReader(text.splitlines())}  # fmt: skip


def table11(s: Settings, out: Path) -> Iterator[Record]:
    """GaLore Table 11 (LLaMA-1B, token batch 256, bf16): memory and tok/s beside the paper's."""
    paper = _paper_table11()
    for label, (method, layerwise, row) in TABLE11.items():
        if s.table11_rows is not None and label not in s.table11_rows:
            continue
        if method["name"] == "galore":  # randomized SVDs, as at 7B: the first step's 168
            # exact ones (cuSOLVER, 2048 × 5461 and 2048²; not yet timed on a device) could take
            # minutes of the part's cap over four rows, before the MFU sweep; the steady steps
            # measured hold the same tensors
            method = {**method, "rank": s.rank_1b, "svd": "randomized"}
        run = _run(s, s.table11, method, layerwise, steps=12 if s.device == "cuda" else 3,
                   precision="bf16-true")
        gb, tok_s = paper.get((row, layerwise), (None, None)) if row else (None, None)
        yield {"name": f"gpu/table11/{s.table11}/{label}", **_measured(run),
               "estimate_peak_bytes": estimate_run(run)["peak_bytes"],
               "paper_gb": gb, "paper_tokens_per_s": tok_s}


def mfu(s: Settings, out: Path) -> Iterator[Record]:
    """Full AdamW's MFU at LLaMA-1B, bf16-true, over micro-batches until one does not fit;
    then, at the best one, what bounds it: each of the model's matmuls alone (the GEMM probe),
    and the same run under train.compile."""
    best: tuple[Record, Any] | None = None  # the fastest run's record and config
    for batch in s.mfu_batches:
        run = _mfu_run(s, batch)
        record = {"name": f"gpu/mfu/{s.table11}/full/batch{batch}", "batch": batch,
                  **_measured(run)}
        yield record
        if record["status"] != "ok":
            break
        # tok/s orders the runs as MFU does (one model: the same FLOPs a token); a CPU has no MFU
        if best is None or record["tokens_per_s"] > best[0]["tokens_per_s"]:
            best = record, run
    if best is None:
        return
    record, run = best
    yield {"name": f"gpu/mfu/{s.table11}/full/best", "value": record["mfu"],
           "target": MFU_TARGET, "batch": record["batch"], "tokens_per_s": record["tokens_per_s"],
           "met": record["mfu"] is not None and record["mfu"] >= MFU_TARGET}
    yield from gemms(s, record["batch"] * run.task.seq_len, vocab_size(run.task.tokenizer))
    if s.mfu_compile:
        batch = record["batch"]
        compiled = _measured(_mfu_run(s, batch, compile=True))
        yield {"name": f"gpu/mfu/{s.table11}/full/compiled/batch{batch}", "batch": batch,
               **compiled, "target": MFU_TARGET,
               "met": compiled.get("mfu") is not None and compiled["mfu"] >= MFU_TARGET}


def _mfu_run(s: Settings, batch: int, **train: Any) -> Any:
    return _run(s, s.table11, {"name": "full"}, batch_size=batch,
                steps=8 if s.device == "cuda" else 3, precision="bf16-true", **train)


def _up(n: int) -> int:
    return -(-n // 64) * 64


def gemm_shapes(model: str, vocab: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """(out, in, the shape it was rounded up from or None) of each distinct matmul of the
    model (every 2-D weight but the input embedding, a lookup), and each with a dimension that
    is no multiple of 64 again with it rounded up: LLaMA-1B's MLP is 5461 wide, which leaves
    the bf16 tensor cores' tiles ragged."""
    shapes = sorted({(size[0], size[1]) for name, size in param_shapes(model, vocab).items()
                     if len(size) == 2 and "embed_tokens" not in name})
    padded = [(_up(o), _up(i), (o, i)) for o, i in shapes if (_up(o), _up(i)) != (o, i)]
    return [(o, i, None) for o, i in shapes] + padded


def gemms(s: Settings, tokens: int, vocab: int) -> Iterator[Record]:
    """Each matmul a linear layer's step makes (forward, input gradient, weight gradient:
    2 · tokens · in · out FLOPs each) alone on random bf16 data: the TFLOP/s the model's
    shapes can reach on this device, beside its peak."""
    free_memory()  # what an over-budget run of the sweep left
    device = torch.device(s.device)
    peak = peak_flops(device, "bf16-true")
    for out_f, in_f, padded_from in gemm_shapes(s.table11, vocab):
        # random data, never zeros: those can run faster than real values
        w, x, g = (torch.randn(*shape, device=device, dtype=torch.bfloat16)
                   for shape in ((out_f, in_f), (tokens, in_f), (tokens, out_f)))
        tflops = {name: 2 * tokens * in_f * out_f / _seconds(f, *args, s.gemm_s) / 1e12
                  for name, f, args in (("forward", torch.nn.functional.linear, (x, w)),
                                        ("input_grad", torch.matmul, (g, w)),
                                        ("weight_grad", torch.matmul, (g.t(), x)))}
        yield {"name": f"gpu/mfu/{s.table11}/gemm/{out_f}x{in_f}", "tokens": tokens,
               "out": out_f, "in": in_f, "padded_from": padded_from, "tflops": tflops,
               "peak_tflops": None if peak is None else peak / 1e12}


def _seconds(f: Callable[..., Any], a: torch.Tensor, b: torch.Tensor, least_s: float) -> float:
    """The median time of f(a, b), from torch's benchmark Timer (it warms up and synchronizes
    the device around each block of runs)."""
    timer = Timer("f(a, b)", globals={"f": f, "a": a, "b": b})
    return timer.blocked_autorange(min_run_time=least_s).median


def loop(s: Settings, out: Path) -> Iterator[Record]:
    """`harness bench loop` on the device: the harness's loop over a bare PyTorch loop."""
    model, steps, batch, seq_len, precision, rounds = s.loop
    rows = bench_loop(bench_run(model, steps, batch, seq_len, precision, s.device), rounds)
    ratio = statistics.median(r["ratio"] for r in rows)  # as `harness bench loop` reports it
    yield {"name": f"gpu/loop/{model}/{precision}", "value": ratio, "target": TARGET,
           "rounds": rows, "met": verdict(ratio, TARGET) == "met"}


# label -> (method, layer-wise, the paper's figure: a PAPER_7B row or (GB, source)). The first
# step's SVDs of 224 7B matrices take minutes, so GaLore's are randomized (the steady step
# measured holds the same tensors); Q-GaLore has only exact ones. Order: what a device has
# yet to measure first (APOLLO-Mini INT8 since its update was chunked, Q-GaLore), 8-bit
# GaLore layer-wise (measured, met: docs/benchmarks.md) last, where the cap may cut it off.
BIG = {
    "apollo_mini_int8_layerwise": ({"name": "apollo_mini", "int8_weights": True}, True,
                                   (12.0, "APOLLO: LLaMA-7B under 12 GB (APOLLO-Mini, INT8 "
                                          "weights, layer-wise, batch 1)")),
    "qgalore": ({"name": "qgalore"}, False, "Q-GaLore"),
    "galore_8bit_layerwise": ({"name": "galore", "optimizer": "adam8bit", "svd": "randomized"},
                              True, "8-bit GaLore layer-wise"),
}


def llama7b(s: Settings, out: Path) -> Iterator[Record]:
    """LLaMA-7B optimizer steps under bf16-true at 1 × 256 tokens: the measured peak against
    the estimate (same vocabulary) and the papers' figures (the estimate at their 32K
    vocabulary beside them)."""
    for label, (method, layerwise, paper) in BIG.items():
        if method["name"] != "apollo_mini":
            method = {**method, "rank": s.rank_7b}
        run = _run(s, s.big, method, layerwise, precision="bf16-true")
        gb, source = PAPER_7B[paper] if isinstance(paper, str) else paper
        paper_run = run.model_copy(update={"task": run.task.model_copy(
            update={"tokenizer": PAPER_TOKENIZER, "seq_len": 256})})
        predicted = estimate_run(run)["peak_bytes"]
        record = {"name": f"gpu/llama7b/{s.big}/{label}", **_measured(run),
                  "estimate_peak_bytes": predicted,
                  "estimate_at_paper_vocab_bytes": estimate_run(paper_run)["peak_bytes"],
                  "paper_gb": gb, "paper_source": source}
        if record["status"] == "ok":
            ratio = record["peak_bytes"] / predicted
            record.update(ratio=ratio, tolerance=0.05, met=abs(ratio - 1) <= 0.05)
        yield record


PARTS: dict[str, Callable[[Settings, Path], Iterator[Record]]] = {
    "tests": tests, "estimate": estimate, "table11": table11, "mfu": mfu, "loop": loop,
    "llama7b": llama7b,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.gpu_parts")
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else GPU
    with (args.out / f"{args.part}.jsonl").open("a") as f:
        for record in PARTS[args.part](settings, args.out):
            f.write(json.dumps({**record, "device": settings.device}, default=str) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
