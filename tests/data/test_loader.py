"""harness/data/loader.py: micro-batches from a background thread are the stream's blocks in
order, their position restores a stream exactly, and data-parallel ranks split each round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.config import TaskConfig
from harness.data.c4 import BlockStream
from harness.data.loader import IGNORE, Prefetcher, to_batch

CPU = torch.device("cpu")
TASK = TaskConfig(seq_len=16, shuffle_buffer=8)


def direct(stream: BlockStream, batches: int, size: int) -> list[torch.Tensor]:
    """What the prefetcher should hand out: the stream's blocks, stacked in order."""
    return [torch.from_numpy(np.stack([stream.next_block()[0] for _ in range(size)]).astype(
        np.int64)) for _ in range(batches)]


def test_to_batch_masks_padding_and_copies_the_labels():
    blocks = [(np.array([5, 6, 7, 1], np.int32), 4), (np.array([8, 1, 0, 0], np.int32), 2)]
    ids, labels = to_batch(blocks, pin=False)
    assert ids.dtype == torch.int64 and ids.tolist() == [[5, 6, 7, 1], [8, 1, 0, 0]]
    assert labels.tolist() == [[5, 6, 7, 1], [8, 1, IGNORE, IGNORE]]
    labels[0, 0] = 99
    assert ids[0, 0] == 5  # labels are their own tensor


def test_batches_are_the_streams_blocks_in_order(sample_tokenizer):
    expected = direct(BlockStream(TASK, sample_tokenizer, seed=0), 5, 2)
    loader = Prefetcher(BlockStream(TASK, sample_tokenizer, seed=0), 2, CPU, depth=2)
    try:
        for want in expected:
            ids, labels = loader.next()
            assert ids.shape == (2, 16) and ids.device == CPU
            assert torch.equal(ids, want) and torch.equal(labels, want)  # packed: no padding
    finally:
        loader.close()
    assert not loader.thread.is_alive()


def test_state_is_the_position_after_the_last_batch_taken(sample_tokenizer):
    """The thread has read ahead (depth 4), but `state` is where the consumer stands."""
    loader = Prefetcher(BlockStream(TASK, sample_tokenizer, seed=1), 2, CPU, depth=4)
    try:
        start = loader.state()
        for _ in range(3):
            loader.next()
        state = loader.state()
        following = [loader.next()[0] for _ in range(2)]
    finally:
        loader.close()
    resumed = BlockStream(TASK, sample_tokenizer, seed=1)
    resumed.restore(state)
    assert all(torch.equal(a, b) for a, b in zip(following, direct(resumed, 2, 2), strict=True))
    fresh = BlockStream(TASK, sample_tokenizer, seed=1)
    fresh.restore(start)
    assert torch.equal(direct(fresh, 1, 2)[0], direct(BlockStream(TASK, sample_tokenizer, 1),
                                                      1, 2)[0])


def test_ranks_split_each_round_like_one_process(sample_tokenizer):
    """World 2, micro-batch 2: rank r takes rows 2r, 2r+1 of one process's batch of 4, and
    both stand at the same position after the round."""
    whole = direct(BlockStream(TASK, sample_tokenizer, seed=0), 3, 4)
    loaders = [Prefetcher(BlockStream(TASK, sample_tokenizer, seed=0), 2, CPU, rank=r, world=2)
               for r in (0, 1)]
    try:
        for want in whole:
            parts = [loader.next()[0] for loader in loaders]
            assert torch.equal(torch.cat(parts), want)
        a, b = (loader.state() for loader in loaders)
        assert a["epoch"] == b["epoch"] and np.array_equal(a["carry"], b["carry"])
        assert a["reader"] == b["reader"]
    finally:
        for loader in loaders:
            loader.close()


def test_padding_reaches_the_labels_as_ignore(tiny_corpus, sample_tokenizer):
    task = TaskConfig(dataset=str(tiny_corpus), seq_len=8, packing=False, shuffle_buffer=2)
    loader = Prefetcher(BlockStream(task, sample_tokenizer, seed=0), 3, CPU)
    try:
        ids, labels = loader.next()
    finally:
        loader.close()
    eos, pad = sample_tokenizer.eos_token_id, sample_tokenizer.pad_token_id
    for row, label in zip(ids.tolist(), labels.tolist(), strict=True):
        valid = row.index(eos) + 1  # "train doc N" and its EOS, then padding
        assert valid < 8 and label[:valid] == row[:valid]
        assert label[valid:] == [IGNORE] * (8 - valid)
        assert row[valid:] == [pad if pad is not None else eos] * (8 - valid)


class Broken:
    """A stream whose reader fails on the third block, as a corrupt shard would."""

    def __init__(self):
        self.n = 0

    def state(self):
        return {"n": self.n}

    def next_block(self):
        self.n += 1
        if self.n == 3:
            raise OSError("shard 7 is truncated")
        return np.arange(4, dtype=np.int32), 4


def test_an_error_in_the_thread_is_raised_in_the_consumer():
    loader = Prefetcher(Broken(), 2, CPU)
    try:
        assert loader.next()[0].shape == (2, 4)
        with pytest.raises(OSError, match="shard 7 is truncated"):
            loader.next()
    finally:
        loader.close()
