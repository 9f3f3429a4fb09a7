"""Reading split over data-parallel ranks (`task.read_shards: N`).

The training stream is defined by N alone: shard k holds the files k, k+N, k+2N, … of the
source (in its sorted order) and is read in order, again and again (a pass each); the stream's
position j is shard j mod N's next document. Rank r of W reads only the shards k ≡ r (mod W),
so each rank reads about 1/W of the files, and the stream, and so the batches, are the same at
any W that divides N. Every rank holds the same shuffle buffer of positions; the texts are held
by their owners alone, who tokenize them (harness/data/split.py `by_owner`).

A rank's position holds its own shards and texts; `merge` joins every rank's into a position
that restores at any world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from harness.errors import UserError

Opener = Callable[[list[str]], Any]  # files -> an iterable of {'text': ...} with state_dict()


class Shard:
    """One shard's files read in order, a pass after another; the position is the pass and
    the reader's own state (`datasets`' IterableDataset.state_dict)."""

    def __init__(self, files: list[str], opener: Opener) -> None:
        self.files, self.opener = files, opener
        self.passes = 0
        self.saved: dict[str, Any] | None = None  # a reader state to load when opened
        self.docs: Any = None
        self._iter: Any = None
        self._read_in_pass = False

    def next(self) -> str:
        for _ in range(2):  # at most one new pass per document: an empty shard must not spin
            if self._iter is None:
                self.docs = self.opener(self.files)
                if self.saved is not None:
                    self.docs.load_state_dict(self.saved)
                    self._read_in_pass = True  # a restored pass has read before
                self._iter = iter(self.docs)
            for row in self._iter:
                self._read_in_pass = True
                return row["text"]
            if not self._read_in_pass:
                break
            self.passes += 1
            self.saved, self.docs, self._iter, self._read_in_pass = None, None, None, False
        raise UserError(f"task.dataset: the read shard of {self.files[0]} (and "
                        f"{len(self.files) - 1} more files) holds no documents; with "
                        "task.read_shards every shard needs one")

    def state(self) -> dict[str, Any]:
        reader = self.saved if self.docs is None else self.docs.state_dict()
        return {"passes": self.passes, "reader": copy.deepcopy(reader)}

    def restore(self, state: dict[str, Any]) -> None:
        self.passes, self.saved = state["passes"], copy.deepcopy(state["reader"])
        self.docs, self._iter, self._read_in_pass = None, None, False


def check(n: int, files: int, world: int, dataset: str) -> None:
    if n > files or n % world:
        raise UserError(
            f"task.read_shards: {n} does not fit (a shard is whole files, and '{dataset}' has "
            f"{files} training files, read by {world} ranks; allowed: a multiple of {world} "
            f"up to {files})"
        )


class ShardedDocs:
    """The stream's positions in order; this rank's texts, read from its shards alone."""

    def __init__(self, files: list[str], n: int, rank: int, world: int, opener: Opener) -> None:
        self.n, self.rank, self.world = n, rank, world
        self.shards = {k: Shard(files[k::n], opener) for k in range(rank, n, world)}
        self.position = 0  # positions read so far, alike on every rank
        self.texts: dict[int, str] = {}  # this rank's read and not yet drawn, by position
        # the other ranks' part, known until this rank reads (fresh, or just restored whole)
        fresh = {"passes": 0, "reader": None}
        self.foreign: dict[str, Any] | None = {
            "texts": {}, "shards": {k: fresh for k in range(n) if k not in self.shards}}

    def owner(self, position: int) -> int:
        return position % self.n % self.world

    def read(self, count: int) -> list[int]:
        """The next `count` positions, this rank's texts of them read and kept."""
        self.foreign = None
        positions = list(range(self.position, self.position + count))
        for j in positions:
            if self.owner(j) == self.rank:
                self.texts[j] = self.shards[j % self.n].next()
        self.position += count
        return positions

    def take(self, drawn: list[int]) -> tuple[list[str], list[int]]:
        """This rank's texts of the drawn positions, in order, and every position's owner."""
        self.foreign = None
        owners = [self.owner(j) for j in drawn]
        mine = [self.texts.pop(j) for j, o in zip(drawn, owners, strict=True) if o == self.rank]
        return mine, owners

    def state(self) -> dict[str, Any]:
        mine = {"n": self.n, "position": self.position, "texts": dict(self.texts),
                "shards": {k: s.state() for k, s in self.shards.items()}}
        return mine if self.foreign is None else merge([mine, {**mine, **self.foreign}])

    def restore(self, state: dict[str, Any]) -> None:
        """From a whole position (`merge`'s, or one rank's alone): what this rank owns now;
        until it reads, its position is that whole one."""
        self.position = state["position"]
        self.texts = {j: t for j, t in state["texts"].items() if self.owner(j) == self.rank}
        for k, shard in self.shards.items():
            shard.restore(state["shards"][k])
        self.foreign = {"texts": {j: t for j, t in state["texts"].items() if j not in self.texts},
                        "shards": {k: s for k, s in state["shards"].items()
                                   if k not in self.shards}}

    def whole(self, state: dict[str, Any]) -> bool:
        """Whether a position holds every shard (one rank's holds its own alone)."""
        return len(state["shards"]) == self.n


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's position (`ShardedDocs.state`) as one, whole: all shards, all texts."""
    whole = {"n": parts[0]["n"], "position": parts[0]["position"], "texts": {}, "shards": {}}
    for part in parts:
        whole["texts"].update(part["texts"])
        whole["shards"].update(part["shards"])
    return whole
