"""The diagnostic run on the H200 on 2026-11-28 after the CUDA kit (probe.log beside it): each
method alone in a fresh sequence, the bytes still allocated after every run, and a memory
snapshot of one steady step. `python probe.py OUT`, after the kit's install line."""

import gc
import gzip
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.bench.gpu_parts import GPU, SMOKE, _run
from harness.bench.memory import _Unsaved, free_memory, measure_run, method_records, method_run
from harness.train import Trainer

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
cuda = torch.cuda.is_available()
s = GPU if cuda else SMOKE
t0 = time.time()


def say(text: str) -> None:
    print(f"[{time.time() - t0:.0f}s] {text}", flush=True)


def live(tag: str) -> None:
    """Bytes allocated after a collection, and the Python-visible tensors of 1 MiB or more."""
    free_memory()
    seen, total, rows = set(), 0, []
    for o in gc.get_objects():
        if torch.is_tensor(o) and o.device.type == ("cuda" if cuda else "cpu"):
            storage = o.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() < 1 << 20:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
            rows.append((storage.nbytes(), tuple(o.shape), str(o.dtype)))
    allocated = torch.cuda.memory_allocated() if cuda else 0
    say(f"{tag}: allocated {allocated:,} python-visible>=1MiB {total:,} in {len(rows)}")
    for row in sorted(rows, reverse=True)[:8]:
        print("    ", row, flush=True)


live("start")
for label in ("full", "galore", "adam_mini"):
    for r in method_records(label, s.presets[-1], s.steps, s.seq_len, s.batch_size):
        if r["name"].endswith("peak_bytes"):
            say(f"{r['name']} {r['value']:,} est {r['estimate']:,} "
                f"diff {r['value'] - r['estimate']:,}")
    live(f"after {label}@{s.presets[-1]}")

for label in ("full", "adam8bit"):
    run = _run(s, s.table11, {"name": label}, False, steps=6 if cuda else 3,
               precision="bf16-true")
    results, peak = measure_run(run)
    say(f"1b {label}: peak {peak:,} tok/s {results['tokens_per_s']:.0f}")
    live(f"after 1b {label}")

if cuda:  # what is alive at the peak of step 3 of full at llama_60m
    run = method_run("full", s.presets[0], 4, s.seq_len, s.batch_size)
    free_memory()
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(run, _Unsaved(Path(d), run), lambda step: False)

        def snapshot(step):
            if step.number == 2:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            if step.number == 3:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                with gzip.open(out / "snap.pkl.gz", "wb") as f:
                    pickle.dump(snap, f)
                print("snapshot at step 3, max", torch.cuda.max_memory_allocated(), flush=True)

        trainer.hooks.on("step", snapshot)
        trainer.fit()
        trainer.close()
    del trainer
    live("after snapshot run")
print("done", time.time() - t0)
