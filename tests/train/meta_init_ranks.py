"""Each rank of tests/train/test_meta_init.py's launches (forked with torchrun's environment,
tests/ranks.py). `equal OUT CONFIG...`: each run config's model built by the trainer's setup
steps under fsdp, on the meta device, against the same rank's ordinary whole build (the steps
with one shard: no meta device, no broadcast) bitwise, and the generator after both; `rss OUT
CONFIG`: this rank's peak resident memory while the setup steps build and shard the model."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# imported before the baseline of `rss`: code, not model
import torch.distributed.fsdp
import transformers.models.llama.modeling_llama  # noqa: F401
import yaml

from harness import distributed
from harness.distributed import fsdp
from harness.methods.resolve import load_run
from harness.train import setup


def built(run: Any, steps: Any, device: torch.device, shard: bool = True,
          marks: dict[str, int] | None = None) -> tuple[torch.nn.Module, bool]:
    """The model as the setup steps leave it before the optimizer (`shard`: sharded), and
    whether it was on the meta device until then; `marks`: resident KiB after each step."""
    marks = {} if marks is None else marks
    model, _, data = setup.model(run, steps, device)
    marks["model"] = kib("VmRSS")
    chosen, _ = setup.method(setup.budget(run, data), steps, model)
    model, _ = setup.modifiers(model, chosen, run, device)
    marks["modifiers"] = kib("VmRSS")
    meta = all(p.is_meta for p in model.parameters())
    if shard:
        setup.parallelize(model, run, steps, device)
        marks["parallelize"] = kib("VmRSS")
    data.close()
    return model, meta


def equal(run: Any) -> dict[str, Any]:
    steps, device = setup.join(run)
    whole, _ = built(run, replace(steps, shards=1), device, shard=False)
    reference = {k: v.detach().clone() for k, v in whole.state_dict().items()}
    after = torch.get_rng_state()
    del whole
    sharded, meta = built(run, steps, device)
    state = {k: fsdp.full(v).detach() for k, v in sharded.state_dict().items()}
    differ = [k for k in reference if k not in state or not torch.equal(reference[k], state[k])]
    return {"meta": meta, "differ": differ, "keys": len(reference),
            "generator": torch.equal(after, torch.get_rng_state())}


def kib(field: str) -> int:
    """A /proc/self/status memory figure, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss(run: Any) -> dict[str, Any]:
    """Resident KiB before the build, and the peak from there to the sharded model (the peak
    reset first, so that what the fork server and the imports touched is not counted twice)."""
    steps, device = setup.join(run)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, marks = kib("VmRSS"), {}
    model, meta = built(run, steps, device, marks=marks)
    held = sum(fsdp.local(p).numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())  # whole, sharded or not
    return {"before_kib": before, "peak_kib": kib("VmHWM"), "meta": meta,
            "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "held_bytes": held, "largest_bytes": largest, "marks_kib": marks}


def main(argv: list[str]) -> int:
    """`argv`: the mode, the output folder, the run configs (YAML)."""
    mode, out, configs = argv[0], Path(argv[1]), argv[2:]
    results = {}
    for path in map(Path, configs):
        run = load_run(yaml.safe_load(path.read_text()))
        results[path.stem] = (equal if mode == "equal" else rss)(run)
    gathered = distributed.every_rank(results)
    if distributed.is_main():
        (out / f"{mode}.json").write_text(json.dumps(gathered))
    distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
