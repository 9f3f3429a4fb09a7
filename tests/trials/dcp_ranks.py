"""The sharded checkpoint's cases on W ranks in one launch (tests/trials/test_checkpoints.py):
each rank builds a small FSDP2 model and AdamW, steps once, and saves (blocking, then in the
background); then reads it back, noting each file it verified and opened; then reads it into
a model of another layout. Each rank writes what it saw to `<out>/rank<r>.json`.

    python -m ... OUT   (run by tests/ranks.py's `Ranks(..., module="dcp_ranks")`)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.fsdp import fully_shard

from harness.distributed import fsdp
from harness.errors import UserError
from harness.trials import checkpoints, read_json, sharded


def build(width: int = 32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Linear(width, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def opened_streams(seen: list[str]) -> Any:
    """FileSystem.create_stream, noting every file DCP opens for reading."""
    original = FileSystem.create_stream

    def noting(self: Any, path: Any, mode: str) -> Any:
        if "r" in mode:
            seen.append(str(path))
        return original(self, path, mode)

    return original, noting


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = out / "checkpoint"
    model, opt = build()
    step(model, opt)
    saved = {k: fsdp.local(v).clone() for k, v in model.state_dict().items()}
    checkpoints.save_sharded(folder, dict(zip(("model", "optimizer"),
                                              fsdp.state_dicts(model, [opt]), strict=True)),
                             {"step": 1}, keep=2)
    seen: dict[str, Any] = {}
    # in the background: before `wait` the newest is still step 1's; after it, step 2's
    background = sharded.Background()
    step(model, opt)
    checkpoints.save_sharded(folder, dict(zip(("model", "optimizer"),
                                              fsdp.state_dicts(model, [opt]), strict=True)),
                             {"step": 2}, keep=2, background=background)
    seen["in_flight_newest"] = checkpoints.load_newest(folder).state["step"]
    background.close()
    dist.barrier()
    found = checkpoints.load_newest(folder)
    seen["published_newest"] = found.state["step"]
    newest = [k for k, v in model.state_dict().items()]
    after = {k: fsdp.local(v).clone() for k, v in model.state_dict().items()}
    # read back into a fresh model and optimizer: what each rank verified and opened
    fresh, fresh_opt = build()
    parts = fsdp.state_dicts(fresh, [fresh_opt])
    opened: set[str] = set()
    streams: list[str] = []
    original, noting = opened_streams(streams)
    FileSystem.create_stream = noting  # type: ignore[method-assign]
    try:
        for name, state in zip(("model", "optimizer"), parts, strict=True):
            sharded.load(found.path, name, state, found.state["record"], opened)
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]
    fsdp.set_state_dicts(fresh, [fresh_opt], *parts)
    seen["verified"] = sorted(opened)
    seen["opened"] = sorted({str(Path(p).relative_to(found.path)) for p in streams})
    seen["same_weights"] = all(torch.equal(fsdp.local(fresh.state_dict()[k]), after[k])
                               for k in newest)
    seen["first_save_differs"] = any(not torch.equal(saved[k], after[k]) for k in newest)
    seen["exp_avg_rows"] = list(fsdp.local(fresh_opt.state[fresh[0].weight]["exp_avg"]).shape)
    # another layout: a wider first layer
    other, other_opt = build(width=40)
    try:
        sharded.load(found.path, "model", fsdp.state_dicts(other, [other_opt])[0],
                     found.state["record"])
        seen["layout"] = None
    except UserError as e:
        seen["layout"] = str(e)
    seen["record_items"] = sum(len(v.get("items", {}))
                               for v in read_json(checkpoints.record_of(found.path))["files"]
                               .values())
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
