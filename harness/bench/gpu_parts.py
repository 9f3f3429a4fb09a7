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
from importlib import resources
from pathlib import Path

import torch

from harness.bench.gpu_mfu import mfu
from harness.bench.gpu_settings import GPU, SMOKE, Record, Settings, kit_run, measured
from harness.bench.loop import TARGET, bench_loop, bench_run, verdict
from harness.bench.memory import METHODS, method_records
from harness.cost.estimate import estimate_run
from harness.cost.paper_7b import PAPER_7B

PAPER_TOKENIZER = "t5-base"  # the papers' vocabulary (32,100), for the estimate beside them


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
    """Every method's counted bytes (exact) and steady-step peak (±5%) against the estimate
    (the smoke run: its `estimate_labels` only)."""
    labels = [label for label in METHODS
              if s.estimate_labels is None or label in s.estimate_labels]
    for preset in s.presets:
        for label in labels:
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
        run = kit_run(s, s.table11, method, layerwise, steps=12 if s.device == "cuda" else 3,
                   precision="bf16-true")
        gb, tok_s = paper.get((row, layerwise), (None, None)) if row else (None, None)
        yield {"name": f"gpu/table11/{s.table11}/{label}", **measured(run),
               "estimate_peak_bytes": estimate_run(run)["peak_bytes"],
               "paper_gb": gb, "paper_tokens_per_s": tok_s}


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
        run = kit_run(s, s.big, method, layerwise, precision="bf16-true")
        gb, source = PAPER_7B[paper] if isinstance(paper, str) else paper
        paper_run = run.model_copy(update={"task": run.task.model_copy(
            update={"tokenizer": PAPER_TOKENIZER, "seq_len": 256})})
        predicted = estimate_run(run)["peak_bytes"]
        record = {"name": f"gpu/llama7b/{s.big}/{label}", **measured(run),
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
