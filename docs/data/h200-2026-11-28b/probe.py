"""The second H200 lease's diagnostic (2026-11-28, evening; probe.log beside it): where the
steady-step peak of the runs the estimate missed goes. For each run, a memory history of step 3
(after the peak reset at the end of step 2) is replayed: the allocations made in that step and
alive at its highest point, summed by the harness line that made them. `python probe.py OUT`,
after the kit's install line."""

import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from harness.bench.gpu_parts import GPU, _run
from harness.bench.memory import _Unsaved, free_memory, method_run
from harness.cost.estimate import estimate_run
from harness.train import Trainer

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
t0 = time.time()
OURS = ("/harness/", "/methods/")


def say(text: str) -> None:
    print(f"[{time.time() - t0:.0f}s] {text}", flush=True)


def where(frames: list[dict]) -> str:
    """The innermost harness line of an allocation, and the innermost line overall."""
    inner = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    ours = next((f for f in frames if any(p in f["filename"] for p in OURS)), None)
    text = f"{inner['filename'].rsplit('/', 1)[-1]}:{inner['line']} {inner['name']}"
    if ours is not None and ours is not inner:
        text = (f"{ours['filename'].split('/site/')[-1]}:{ours['line']} {ours['name']}"
                f"  <- {text}")
    return text


def replay(trace: list[dict], base: int) -> None:
    """The live set at the trace's highest point: what step 3 added above `base`."""
    live: dict[int, tuple[int, str]] = {}
    now = top = 0
    at_top: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            now += e["size"]
            if now > top:
                top, at_top = now, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
        elif e["action"] == "free_requested":
            now -= e["size"]  # a block from before the recording
    say(f"  trace: base {base:,} + step-3 top {top:,} = {base + top:,}")
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, line in at_top.values():
        groups[line][0] += size
        groups[line][1] += 1
    for line, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {size:>14,} B in {n:>4}  {line}", flush=True)


def probe(label: str, run) -> None:
    est = estimate_run(run)
    say(f"{label}: estimate peak {est['peak_bytes']:,} (weights {est['weight_bytes']:,} grads "
        f"{est['grad_bytes']:,} states {est['optimizer_state_bytes']:,} extra "
        f"{est['extra_bytes']:,} activations {est['activation_bytes']:,} workspace "
        f"{est['workspace_bytes']:,})")
    free_memory()
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(run, _Unsaved(Path(d), run), lambda step: False)
        seen: dict[str, int] = {}

        def hook(step):
            if step.number == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                seen["base"] = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
            if step.number == 3:
                torch.cuda.synchronize()
                seen["max"] = torch.cuda.max_memory_allocated()
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                say(f"  measured: before step 3 {seen['base']:,}, step-3 max {seen['max']:,} "
                    f"= {seen['max'] / est['peak_bytes']:.4f} of the estimate")
                replay(snap["device_traces"][torch.cuda.current_device()], seen["base"])

        trainer.hooks.on("step", hook)
        try:
            trainer.fit()
        finally:
            trainer.close()
    del trainer
    free_memory()


say(f"start, allocated {torch.cuda.memory_allocated():,}")
for preset in ("llama_60m", "llama_350m"):
    probe(f"galore@{preset}", method_run("galore", preset, 4, 256, 8))
probe("apollo_mini_int8_layerwise@llama_1b",
      _run(GPU, "llama_1b", {"name": "apollo_mini", "int8_weights": True}, True, steps=4,
           precision="bf16-true"))
probe("galore_8bit_layerwise@llama_1b",
      _run(GPU, "llama_1b", {"name": "galore", "optimizer": "adam8bit", "svd": "randomized",
                             "rank": 512}, True, steps=4, precision="bf16-true"))
probe("full@llama_60m (control)", method_run("full", "llama_60m", 4, 256, 8))
say("done")
