"""Each rank of tests/data/test_split_ranks.py, forked with torchrun's environment at 4 ranks
(tests/ranks.py): the training stream and the validation blocks read as 4 ranks and, on two
groups of 2, as 2 ranks, with the documents each rank tokenized counted; and a stop flag
offered by rank 1 alone; and with `task.read_shards: 4` on a corpus of 4 files, each rank
reading its own, the batches and the joined position. Writes `rank-<r>.json` (blocks and
counts), `state-<W>-<r>.pkl` and `sharded-<W>-<r>.pkl` into the folder given."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import distributed
from harness.config import TaskConfig
from harness.data.c4 import BlockStream, eval_blocks, load_tokenizer
from harness.data.loader import Prefetcher
from harness.data.split import SplitTokenizer
from harness.distributed.host import LateFlag, host_group

BLOCKS = 320  # each world size reads this many blocks in all
SHARDED_BLOCKS = 64  # the same under read_shards
EVAL_TOKENS = 2000
MICRO = 2  # a rank's micro-batch
PAIRS = ([0, 1], [2, 3])


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


def groups(world: int) -> tuple[int, Any]:
    """This rank's rank in its group of `world` (all 4, or a pair) and the group, a new one."""
    rank = dist.get_rank()
    if world == 4:
        return rank, host_group()
    pairs = [dist.new_group(pair, backend="gloo") for pair in PAIRS]
    return rank % 2, pairs[rank // 2]


def read(task: TaskConfig, folder: Path, world: int) -> dict[str, Any]:
    """The batches as the trainer takes them (the prefetch thread); the documents tokenized
    counted on the main thread, where the count does not depend on how far the thread ran
    ahead or on where it was when the others stopped. A group for each: a thread's own."""
    tok = load_tokenizer("sample")
    rank, group = groups(world)
    stream = BlockStream(task, tok, 0, SplitTokenizer(tok, rank, world, group))
    loader = Prefetcher(stream, MICRO, torch.device("cpu"), rank=rank, world=world)
    try:
        batches = [loader.next()[0].tolist() for _ in range(BLOCKS // (MICRO * world))]
        state = loader.state()
    finally:
        loader.close()
    (folder / f"state-{world}-{dist.get_rank()}.pkl").write_bytes(pickle.dumps(state))
    counted = Counting(tok)
    rank, group = groups(world)
    stream = BlockStream(task, counted, 0, SplitTokenizer(counted, rank, world, group))
    for _ in range(BLOCKS):
        stream.next_block()
    return {"batches": batches, "texts": counted.texts, "tokens": counted.tokens}


def read_sharded(task: TaskConfig, folder: Path, world: int) -> list[Any]:
    """The batches as the trainer takes them under read_shards, and the position joined over
    the main thread's group of the ranks (`sharded-<W>-<r>.pkl`)."""
    tok = load_tokenizer("sample")
    rank, group = groups(world)
    stream = BlockStream(task, tok, 0, SplitTokenizer(tok, rank, world, group))
    _, joined = groups(world)
    loader = Prefetcher(stream, MICRO, torch.device("cpu"), rank=rank, world=world,
                        state_group=joined)
    try:
        batches = [loader.next()[0].tolist() for _ in range(SHARDED_BLOCKS // (MICRO * world))]
        state = loader.state()
    finally:
        loader.close()
    (folder / f"sharded-{world}-{dist.get_rank()}.pkl").write_bytes(pickle.dumps(state))
    return batches


def validation(task: TaskConfig, world: int) -> dict[str, Any]:
    tok = Counting(load_tokenizer("sample"))
    rank, group = groups(world)
    blocks = eval_blocks(task, tok, EVAL_TOKENS, SplitTokenizer(tok, rank, world, group))
    return {"blocks": [[b.tolist(), n] for b, n in blocks], "texts": tok.texts}


def main(argv: list[str]) -> int:
    folder, task = Path(argv[0]), TaskConfig(dataset=argv[1], seq_len=32, shuffle_buffer=64)
    distributed.init(torch.device("cpu"))
    rank = dist.get_rank()
    try:
        out = {world: read(task, folder, world) for world in (4, 2)}
        sharded = task.model_copy(update={"dataset": argv[2], "read_shards": 4})
        by_shards = {world: read_sharded(sharded, folder, world) for world in (4, 2)}
        held = {world: validation(task, world) for world in (4, 2)}
        flag = LateFlag()
        agreed = [flag.agree(rank == 1 and i == 2, last=i == 4) for i in range(5)]
    finally:
        distributed.teardown()
    (folder / f"rank-{rank}.json").write_text(json.dumps({"reads": out, "validation": held,
                                                          "agreed": agreed,
                                                          "sharded": by_shards}))
    return 0
