"""Tokenization split over data-parallel ranks.

Packing needs every document's token count before it, so a rank cannot skip documents. Every
rank reads and draws the same documents (reading text costs far less than tokenizing it), each
tokenizes every W-th of a drawn batch (documents i ≡ rank mod W), and the ranks all-gather the
token ids over a gloo group of their own (the prefetch thread's: a collective issued from it on
the trainer's group would interleave with the trainer's collectives). Each rank then packs the
whole stream, as one process would, and keeps its blocks. Per exchange a rank receives every
rank's header (8 bytes a document) and token ids (4 bytes a token, each rank's padded to the
longest share), so about 4 bytes per token of the global batch.

Under `task.read_shards` (harness/data/shards.py) a rank reads only its shards' texts: each
drawn document is tokenized by the rank that read it (`by_owner`), which may hold up to the
whole drawn batch, so the headers have a slot for each.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

DOCS_PER_RANK = 16  # documents each rank tokenizes per exchange (W > 1)


class StreamEnded(Exception):
    """Another rank stopped reading (its trial is closing): this rank's stream ends too."""


def encode(tok: Any, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
            for text in texts]


def gather(mine: np.ndarray, world: int, group: Any) -> list[np.ndarray]:
    """Every rank's array of `mine`'s shape, in rank order. numpy buffers: host memory outside
    torch's allocator, so the tensor peak a trainer measures is its step's alone."""
    every = [np.empty_like(mine) for _ in range(world)]
    dist.all_gather([torch.from_numpy(a) for a in every], torch.from_numpy(mine), group=group)
    return every


class SplitTokenizer:
    """Token ids of a batch of texts that every rank holds alike, each rank tokenizing its
    share. One process (or no group): all of them, one batch a document, as before."""

    def __init__(self, tok: Any, rank: int = 0, world: int = 1, group: Any = None) -> None:
        self.tok, self.rank, self.world, self.group = tok, rank, world, group
        self.ended = False
        self.slots = DOCS_PER_RANK  # documents a rank may bring to one exchange

    def owned(self) -> None:
        """Documents go to their owner (`by_owner`), who may hold a whole batch of them."""
        self.slots = self.batch

    @property
    def batch(self) -> int:
        """Documents to draw ahead and tokenize together."""
        return DOCS_PER_RANK * self.world if self.split else 1

    @property
    def split(self) -> bool:
        return self.world > 1 and self.group is not None

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if not self.split or not texts:  # every rank holds the same texts: all skip alike
            return encode(self.tok, texts)
        docs = self._exchange(encode(self.tok, texts[self.rank :: self.world]))
        return [docs[i % self.world][i // self.world] for i in range(len(texts))]

    def by_owner(self, mine: list[str], owners: list[int]) -> list[np.ndarray]:
        """Token ids of a drawn batch whose texts only their owners read (`task.read_shards`):
        `mine` this rank's texts in drawn order, `owners[i]` the rank holding document i,
        alike on every rank."""
        if not self.split:
            return encode(self.tok, mine)
        docs = [iter(d) for d in self._exchange(encode(self.tok, mine))]
        return [next(docs[owner]) for owner in owners]

    def _exchange(self, mine: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Every rank's token ids, in rank order (each list padded with empty arrays)."""
        if self.ended:
            raise StreamEnded("the data stream ended: another rank stopped reading")
        lengths = self._headers([len(ids) for ids in mine], stop=False).clip(min=0)
        # padded to the longest share (one token at least: documents may be empty)
        flat = np.zeros(max(1, lengths.sum(1).max()), dtype=np.int32)
        if mine:
            flat[: lengths[self.rank].sum()] = np.concatenate(mine)
        parts = gather(flat, self.world, self.group)
        return [np.split(part, np.cumsum(n)) for part, n in zip(parts, lengths, strict=True)]

    def _headers(self, lengths: list[int], stop: bool) -> np.ndarray:
        """Every rank's document lengths (W × slots, -1 past its share); a rank that stops
        says so here, and then every rank's stream ends."""
        mine = np.full(self.slots + 1, -1, dtype=np.int64)
        mine[0] = int(stop)
        mine[1 : 1 + len(lengths)] = lengths
        headers = np.stack(gather(mine, self.world, self.group))
        if (headers[:, 0] > 0).any():
            self.ended = True
            raise StreamEnded("the data stream ended: another rank stopped reading")
        return headers[:, 1:]

    def end(self) -> None:
        """This rank stops reading: the others, waiting in or reaching the next exchange, are
        told so there, instead of waiting for this rank until the collective's timeout."""
        if self.split and not self.ended:
            with contextlib.suppress(StreamEnded):  # it was the last exchange anyway
                self._headers([], stop=True)
