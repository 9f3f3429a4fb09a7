"""`task.read_shards` (harness/data/shards.py): each rank reads only its files and tokenizes
only their documents, and the blocks are one process's for the same N at 1, 2 and 4 ranks. The
ranks run as threads of this process, their token exchange (split.gather) served by a barrier
instead of gloo; the real gloo path runs in tests/data/test_split_ranks.py's launch."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import write_c4_shards
from split_ranks import Counting

from harness.config import RunConfig, TaskConfig
from harness.data import c4, split
from harness.data.c4 import BlockStream, load_tokenizer
from harness.data.shards import ShardedDocs, merge
from harness.data.split import DOCS_PER_RANK, SplitTokenizer
from harness.errors import UserError

FILES = 8
BLOCKS = 120  # a 32-token block packs a few documents: about 400 of the 960 are read
DOCS = 960


def corpus(root: Path) -> Path:
    """960 documents of 3 to 40 words over FILES C4-named files, 120 each."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    docs = [" ".join([f"document {i}"] + [words[(i * 7 + j) % len(words)]
                                         for j in range(1 + i % 38)]) for i in range(DOCS)]
    return write_c4_shards(root, {"train": docs, "validation": docs[:20]}, shards=FILES)


class Exchange:
    """An all-gather among `world` threads: each hands in its array, all get every rank's."""

    def __init__(self, world: int) -> None:
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world)

    def member(self, rank: int) -> Any:
        return lambda mine: self._gather(rank, mine)

    def _gather(self, rank: int, mine: np.ndarray) -> list[np.ndarray]:
        self.slots[rank] = mine.copy()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # all have taken theirs before the next round writes
        return every


@pytest.fixture
def counted(monkeypatch):
    """Thread-served exchanges, and the files each rank (thread) opens and rows it reads."""
    monkeypatch.setattr(split, "gather", lambda mine, world, group: group(mine))
    opened: dict[str, list[str]] = {}
    rows: Counter[str] = Counter()
    real = c4.open_files

    class Reader:
        def __init__(self, task: TaskConfig, files: list[str]) -> None:
            self.name = threading.current_thread().name
            opened.setdefault(self.name, []).extend(files)
            self.docs = real(task, files)

        def __iter__(self):
            for row in self.docs:
                rows[self.name] += 1
                yield row

        def state_dict(self):
            return self.docs.state_dict()

        def load_state_dict(self, state):
            self.docs.load_state_dict(state)

    monkeypatch.setattr(c4, "open_files", Reader)
    return opened, rows


def run_ranks(task: TaskConfig, world: int, body, state: dict[str, Any] | None = None):
    """`body(stream)` on `world` threads named rank-<r>, each rank's stream of rank r of
    `world` (restored from `state` first); the results in rank order."""
    exchange = Exchange(world)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            tok = Counting(load_tokenizer("sample"))
            stream = BlockStream(task, tok, 0, SplitTokenizer(tok, r, world, exchange.member(r)))
            if state is not None:
                stream.restore(state)
            out[r] = (body(stream), tok.texts)
        except BaseException as e:
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def take(stream: BlockStream, n: int = BLOCKS) -> list[list[int]]:
    return [stream.next_block()[0].tolist() for _ in range(n)]


def test_each_rank_reads_its_files_alone_and_the_blocks_are_one_processs(tmp_path, counted):
    opened, rows = counted
    task = TaskConfig(dataset=str(corpus(tmp_path / "c")), seq_len=32, shuffle_buffer=64,
                      read_shards=4)
    sizes = {str(p): p.stat().st_size for p in (tmp_path / "c").glob("c4-train.*")}
    alone = run_ranks(task, 1, take)[0]
    read_alone, tokenized_alone = rows["rank-0"], alone[1]
    figures = [f"1 rank: {sum(sizes.values())} bytes in {len(sizes)} files, {read_alone} "
               f"documents read, {tokenized_alone} tokenized"]
    for world in (2, 4):
        opened.clear()
        rows.clear()
        ranks = run_ranks(task, world, take)
        assert all(blocks == alone[0] for blocks, _ in ranks)  # every rank packs the stream
        files = [sorted(set(opened[f"rank-{r}"])) for r in range(world)]
        # rank r opens shards r, r+W, … of 4: the files k ≡ r (mod W) of 8, none twice
        assert files == [sorted(f for f in sizes if int(f.split(".")[-3][:5]) % world == r)
                         for r in range(world)]
        read = [rows[f"rank-{r}"] for r in range(world)]
        # positions go round the shards, each rank's 1/W of them: equal within READ_CHUNK's
        # reads, ahead of the draws
        assert sum(read) == read_alone and max(read) - min(read) <= 1
        tokenized = [n for _, n in ranks]  # drawn ones, each by its owner, a batch at a time
        assert tokenized_alone <= sum(tokenized) < tokenized_alone + DOCS_PER_RANK * world
        assert max(tokenized) < 0.75 * sum(tokenized)
        figures.append(f"{world} ranks: bytes opened {[sum(sizes[f] for f in x) for x in files]}"
                       f", documents read {read}, tokenized {tokenized}")
    print("\n".join(figures))


def test_position_j_is_shard_j_mod_n_whose_files_are_read_in_order_pass_after_pass(tmp_path):
    """File f holds documents f, f+8, f+16, … (written round-robin), 120 of them; shard k of
    4 is files k and k+4."""
    files = sorted(str(p) for p in corpus(tmp_path / "c").glob("c4-train.*"))
    docs = ShardedDocs(files, 4, 0, 1, lambda part: c4.open_files(TaskConfig(), part))
    assert docs.read(DOCS + 8) == list(range(DOCS + 8))
    number = {j: int(text.split()[1]) for j, text in docs.texts.items()}
    assert [number[j] for j in range(6)] == [0, 1, 2, 3, 8, 9]
    assert [number[j] for j in range(480, 486)] == [4, 5, 6, 7, 12, 13]  # shards' 2nd files
    assert [number[j] for j in range(DOCS, DOCS + 6)] == [0, 1, 2, 3, 8, 9]  # a second pass
    assert [s.passes for s in docs.shards.values()] == [1, 1, 1, 1]


def test_the_stream_depends_on_n_alone(tmp_path, counted):
    task = TaskConfig(dataset=str(corpus(tmp_path / "c")), seq_len=32, shuffle_buffer=64)
    four = run_ranks(task.model_copy(update={"read_shards": 4}), 1, take)[0][0]
    assert run_ranks(task.model_copy(update={"read_shards": 4}), 4, take)[2][0] == four
    assert run_ranks(task.model_copy(update={"read_shards": 8}), 1, take)[0][0] != four


def test_a_position_joined_from_the_ranks_resumes_at_any_world_size(tmp_path, counted):
    task = TaskConfig(dataset=str(corpus(tmp_path / "c")), seq_len=32, shuffle_buffer=64,
                      read_shards=4)
    unbroken = run_ranks(task, 1, lambda s: take(s, 2 * BLOCKS))[0][0]

    def half(stream: BlockStream) -> tuple[list[list[int]], dict[str, Any]]:
        return take(stream), stream.state()

    for world, later in ((2, 4), (4, 1), (2, 2)):
        parts = [r[0][1] for r in run_ranks(task, world, half)]
        assert len(parts[0]["reader"]["shards"]) == 4 // world  # a rank holds its own alone
        whole = {**parts[0], "reader": merge([p["reader"] for p in parts])}
        resumed = run_ranks(task, later, lambda s: (s.state(), take(s)), state=whole)
        for (unread, blocks), _ in resumed:
            assert blocks == unbroken[BLOCKS:], (world, later)
            assert unread["reader"] == whole["reader"]  # a checkpoint before reading: whole


def test_the_hubs_c4_is_read_by_file_through_datasets(tmp_path, counted, monkeypatch):
    """The hub's C4 files by name: here local stand-ins, named as allenai/c4's `en` ones."""
    opened, _ = counted
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(c4, "offline", lambda: "")
    monkeypatch.setattr(c4, "C4_HUB", str(corpus(tmp_path / "en")))
    monkeypatch.setattr(c4, "C4_TRAIN_FILES", FILES)
    local = TaskConfig(dataset=str(tmp_path / "en"), seq_len=32, shuffle_buffer=64,
                       read_shards=4)
    hub = local.model_copy(update={"dataset": "c4"})
    assert run_ranks(hub, 2, take)[0][0] == run_ranks(local, 1, take)[0][0]
    assert sorted(opened["rank-1"]) == [f"{tmp_path}/en/c4-train.{k:05d}-of-00008.json.gz"
                                        for k in (1, 3, 5, 7)]


@pytest.mark.parametrize(("n", "world", "dataset", "files"), [
    (3, 2, "c", 8), (16, 4, "c", 8), (2, 2, "sample", 1)])
def test_a_read_shards_that_does_not_fit_is_one_line(tmp_path, n, world, dataset, files):
    root = str(corpus(tmp_path / "c")) if dataset == "c" else dataset
    tok = load_tokenizer("sample")
    with pytest.raises(UserError) as raised:
        BlockStream(TaskConfig(dataset=root, read_shards=n), tok, 0,
                    SplitTokenizer(tok, 0, world, object()))
    assert str(raised.value) == (
        f"task.read_shards: {n} does not fit (a shard is whole files, and '{root}' has {files} "
        f"training files, read by {world} ranks; allowed: a multiple of {world} up to {files})")


def test_read_shards_enters_a_trials_id_only_when_set():
    """The id of the default config is the one written before the key existed."""
    assert RunConfig().identity() == "3d478732"  # HEAD before the key
    assert RunConfig(task={"read_shards": 4}).identity() != RunConfig().identity()
    with pytest.raises(ValueError, match="read_shards: splits pretraining text only"):
        TaskConfig(kind="glue", read_shards=2)
