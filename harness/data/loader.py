"""Micro-batches built on a background thread, so tokenization and packing overlap the step."""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import torch

from harness.data.c4 import BlockStream

IGNORE = -100  # label of padding positions: no loss, not counted as a token


def to_batch(blocks: list[tuple[np.ndarray, int]], pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.from_numpy(np.stack([b for b, _ in blocks]).astype(np.int64))
    labels = ids.clone()
    for row, (_, valid) in enumerate(blocks):
        labels[row, valid:] = IGNORE
    if pin:
        ids, labels = ids.pin_memory(), labels.pin_memory()
    return ids, labels


class Prefetcher:
    """Keeps `depth` micro-batches ready; `state()` is the position after the last one taken.

    Data parallel (`world` > 1): every rank packs the same seeded stream in rounds of `world`
    micro-batches and keeps the `rank`-th of each, so in one step the ranks together see exactly
    the micro-batches one process would; the stream's documents are tokenized a share a rank
    (its SplitTokenizer). The position is taken after the whole round, so rank 0's checkpoint
    restores every rank.
    """

    def __init__(self, stream: BlockStream, batch_size: int, device: torch.device, depth: int = 8,
                 rank: int = 0, world: int = 1, state_group: Any = None):
        """`state_group`: the ranks `state()` joins a read_shards position over (default:
        all)."""
        self.stream = stream
        self.state_group = state_group
        self.batch_size = batch_size
        self.device = device
        self.rank, self.world = rank, world
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._state = stream.state()
        self.thread = threading.Thread(target=self._produce, daemon=True, name="prefetch")
        self.thread.start()

    def _produce(self) -> None:
        pin = self.device.type == "cuda"
        try:
            while not self.stop.is_set():
                blocks = [self.stream.next_block() for _ in range(self.batch_size * self.world)]
                mine = blocks[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                self._put((to_batch(mine, pin), self.stream.state()))
            self.stream.end()  # ranks waiting to exchange tokens with this one stop too
        except BaseException as e:  # surfaced in the training thread, where it can be reported
            self._put(e)

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        (ids, labels), self._state = item
        return ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def state(self) -> dict[str, Any]:
        """Under read_shards with several ranks, a collective: every rank calls it at once."""
        return self.stream.whole(self._state, self.state_group)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
