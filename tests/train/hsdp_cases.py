"""Each rank of tests/train/test_hsdp.py's runs, forked with torchrun's environment
(tests/ranks.py): every run config named on the command line trained in turn in one process
group (one launch for many cases), each into the folder named after its file; rank 0 writes
`ranks.json` there, every rank's place in its shard group and the weight elements it holds."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from harness import distributed
from harness.distributed import fsdp
from harness.methods.resolve import load_run
from harness.train.loop import Trainer
from harness.trials import Records


def main(argv: list[str]) -> int:
    """`argv`: the run configs."""
    for path in map(Path, argv):
        run = load_run(yaml.safe_load(path.read_text()))
        out = path.with_suffix("")
        out.mkdir(exist_ok=True)
        trainer = Trainer(run, distributed.main_only(Records(out, run)), lambda step: False,
                          None)
        trainer.fit()
        held = sum(fsdp.local(p).numel() for p in trainer.model.parameters())
        places = distributed.every_rank([*fsdp.shard_ranks(), held])
        trainer.close()
        if distributed.is_main():
            (out / "ranks.json").write_text(json.dumps(places))
        distributed.barrier()
    return 0
