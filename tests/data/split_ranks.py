"""Each rank of tests/data/test_split_ranks.py, forked with torchrun's environment at 4 ranks
(tests/ranks.py): the training stream read as 4 ranks and, on two groups of 2, as 2 ranks,
with the documents each rank tokenized counted; and a stop flag offered by rank 1 alone.
Writes `rank-<r>.json` (batches and counts) and `state-<W>-<r>.pkl` into the folder given."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import distributed
from harness.config import TaskConfig
from harness.data.c4 import BlockStream, load_tokenizer
from harness.data.loader import Prefetcher
from harness.data.split import SplitTokenizer
from harness.distributed.host import LateFlag, host_group

BLOCKS = 320  # each world size reads this many blocks in all
MICRO = 2  # a rank's micro-batch


class Counting:
    """The tokenizer, counting the documents and tokens it is asked for."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.texts, self.tokens = tok, 0, 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        out = self.tok(text, **kwargs)
        self.texts += 1
        self.tokens += len(out["input_ids"])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def read(task: TaskConfig, folder: Path, rank: int, world: int, group: Any) -> dict[str, Any]:
    tok = Counting(load_tokenizer("sample"))
    stream = BlockStream(task, tok, 0, SplitTokenizer(tok, rank, world, group))
    loader = Prefetcher(stream, MICRO, torch.device("cpu"), rank=rank, world=world)
    try:
        batches = [loader.next()[0].tolist() for _ in range(BLOCKS // (MICRO * world))]
        state = loader.state()
    finally:
        loader.close()
    (folder / f"state-{world}-{rank}.pkl").write_bytes(pickle.dumps(state))
    return {"batches": batches, "texts": tok.texts, "tokens": tok.tokens}


def main(argv: list[str]) -> int:
    folder, task = Path(argv[0]), TaskConfig(dataset=argv[1], seq_len=32, shuffle_buffer=64)
    distributed.init(torch.device("cpu"))
    rank = dist.get_rank()
    try:
        four = host_group()
        pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
        out = {4: read(task, folder, rank, 4, four),
               2: read(task, folder, rank % 2, 2, pairs[rank // 2])}
        flag = LateFlag()
        agreed = [flag.agree(rank == 1 and i == 2, last=i == 4) for i in range(5)]
    finally:
        distributed.teardown()
    (folder / f"rank-{rank}.json").write_text(json.dumps({"reads": out, "agreed": agreed}))
    return 0
