"""Data parallel reading (harness/data/split.py) at 1, 2 and 4 ranks in one 4-rank launch
(tests/data/split_ranks.py): the ranks together see exactly one process's blocks, each rank
tokenizes 1/W of the documents (up to one exchange read ahead), and a rank's position restores
the stream in one process; a stop flag offered by one rank is agreed by all one call later.
Under `task.read_shards` (each rank reading its files alone: tests/data/test_read_shards.py
counts them) the batches are one process's and the position joined over gloo restores."""

from __future__ import annotations

import json
import pickle

from conftest import free_port, write_c4_shards
from ranks import Ranks
from split_ranks import BLOCKS, EVAL_TOKENS, PAIRS, SHARDED_BLOCKS, Counting

from harness.config import TaskConfig
from harness.data.c4 import BlockStream, eval_blocks, load_tokenizer
from harness.data.split import DOCS_PER_RANK


def corpus(root, shards=1):
    """400 short documents of 3 to 40 words: a 32-token block packs several."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "by", "a",
             "river"]
    docs = [" ".join([f"document {i}"] + [words[(i * 7 + j) % len(words)]
                                         for j in range(1 + i % 38)]) for i in range(400)]
    return write_c4_shards(root, {"train": docs, "validation": docs[::-1]}, shards)


def test_ranks_tokenize_a_share_and_see_one_processs_blocks(tmp_path):
    task = TaskConfig(dataset=str(corpus(tmp_path / "corpus")), seq_len=32, shuffle_buffer=64)
    sharded = task.model_copy(update={"dataset": str(corpus(tmp_path / "four", 4)),
                                      "read_shards": 4})
    done = Ranks([str(tmp_path), task.dataset, sharded.dataset], 4, free_port(), "split_ranks")
    tok = Counting(load_tokenizer("sample"))  # one process, while the ranks run
    one = BlockStream(task, tok, 0)
    blocks = [one.next_block()[0].tolist() for _ in range(BLOCKS)]
    alone = (tok.texts, tok.tokens)
    after = [one.next_block()[0].tolist() for _ in range(16)]
    tok = Counting(load_tokenizer("sample"))
    held = [[b.tolist(), n] for b, n in eval_blocks(task, tok, EVAL_TOKENS)]
    held_alone = tok.texts
    log, _ = done.communicate(timeout=300)
    assert done.returncode == 0, log
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    figures = [f"1 rank: {alone[0]} documents, {alone[1]} tokens; validation {held_alone}"]
    for world, members in ((4, [0, 1, 2, 3]), *((2, pair) for pair in PAIRS)):
        reads = [ranks[r]["reads"][str(world)] for r in members]
        rounds = zip(*(r["batches"] for r in reads), strict=True)
        assert [row for parts in rounds for part in parts for row in part] == blocks
        texts = {r["texts"] for r in reads}
        assert len(texts) == 1, texts  # an equal share each
        drawn = texts.pop() * world  # drawn DOCS_PER_RANK a rank at a time: at most one ahead
        assert alone[0] <= drawn < alone[0] + DOCS_PER_RANK * world
        assert alone[1] <= sum(r["tokens"] for r in reads)
        for r in members:  # a rank's position, restored in one process, goes on as one would
            state = pickle.loads((tmp_path / f"state-{world}-{r}.pkl").read_bytes())
            resumed = BlockStream(task, load_tokenizer("sample"), 0)
            resumed.restore(state)
            assert [resumed.next_block()[0].tolist() for _ in range(16)] == after
        evals = [ranks[r]["validation"][str(world)] for r in members]
        assert all(e["blocks"] == held for e in evals)
        counts = {e["texts"] for e in evals}
        assert len(counts) == 1 and held_alone <= counts.pop() * world < (
            held_alone + DOCS_PER_RANK * world)
        figures.append(f"{world} ranks {members}: {reads[0]['texts']} documents, "
                       f"{[r['tokens'] for r in reads]} tokens a rank; validation "
                       f"{evals[0]['texts']} a rank")
    print("\n".join(figures))
    assert [r["agreed"] for r in ranks] == [[False, False, False, True, False]] * 4
    one = BlockStream(sharded, load_tokenizer("sample"), 0)
    blocks = [one.next_block()[0].tolist() for _ in range(SHARDED_BLOCKS)]
    after = [one.next_block()[0].tolist() for _ in range(16)]
    for world, members in ((4, [0, 1, 2, 3]), *((2, pair) for pair in PAIRS)):
        rounds = zip(*(ranks[r]["sharded"][str(world)] for r in members), strict=True)
        assert [row for parts in rounds for part in parts for row in part] == blocks
        for r in members:  # every rank's position is the whole one: it restores in one process
            state = pickle.loads((tmp_path / f"sharded-{world}-{r}.pkl").read_bytes())
            assert sorted(state["reader"]["shards"]) == [0, 1, 2, 3]
            resumed = BlockStream(sharded, load_tokenizer("sample"), 0)
            resumed.restore(state)
            assert [resumed.next_block()[0].tolist() for _ in range(16)] == after
