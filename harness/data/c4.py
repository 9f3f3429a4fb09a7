"""C4-style pretraining data: the hub's allenai/c4, local C4 shards, or the embedded sample.

All three go through the same `datasets` streaming reader, then a seeded shuffle buffer, then
packing into `seq_len` blocks (EOS between documents) or the papers' truncate-and-pad. The
whole position (reader, shuffle buffer, RNG, leftover tokens, documents tokenized ahead) is a
picklable state, so a resumed run sees exactly the blocks an uninterrupted one would. Data
parallel, each rank tokenizes a share of the documents (harness/data/split.py); with
`task.read_shards` it also reads only its share of the files (harness/data/shards.py).
"""

from __future__ import annotations

import copy
import glob
import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from harness.config import TaskConfig
from harness.config.hub import cache_only, offline
from harness.data.shards import ShardedDocs, check, merge
from harness.data.split import SplitTokenizer
from harness.errors import UserError, brief

SAMPLE = Path(__file__).parent / "sample"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")  # any one: cached
LOCAL_TOKENIZER = "set task.tokenizer to a folder holding tokenizer.json, or 'sample'"
LOCAL_C4 = ("for local C4 set task.dataset to the folder of c4-train.*.json.gz shards, or use "
            "'sample' (the embedded corpus)")
READ_CHUNK = 64  # documents read from the source per call
C4_HUB = "hf://datasets/allenai/c4/en"  # allenai/c4's `en` files, read by name (read_shards)
C4_TRAIN_FILES = 1024


def load_tokenizer(name: str) -> Any:
    source = str(SAMPLE / "tokenizer") if name == "sample" else name
    folder = Path(source).expanduser().is_dir()
    if _looks_like_path(name) and not folder:
        raise UserError(
            f"task.tokenizer: no folder '{name}' (expected a folder with tokenizer.json, "
            "a hub name such as t5-base, or 'sample')"
        )
    # before transformers is imported: offline, a name not cached fails at once
    cached_only = not folder and cache_only("task.tokenizer", name, TOKENIZER_FILES,
                                            f"{LOCAL_TOKENIZER} (the embedded tokenizer)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=cached_only)
    except Exception as e:  # hub, network and file errors all mean "not loadable here"
        reason = brief(e)
        raise UserError(
            f"task.tokenizer: cannot load '{name}' from a local folder or the Hugging Face hub "
            f"({reason}); {LOCAL_TOKENIZER}"
        ) from None
    if tok.eos_token_id is None:
        raise UserError(
            f"task.tokenizer: '{name}' has no EOS token, needed between packed documents"
        )
    return tok


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _local_files(task: TaskConfig, split: str) -> list[str]:
    root = Path(task.dataset).expanduser()
    if split == "validation" and task.validation:
        pattern = task.validation
    elif root.is_dir():
        pattern = str(root / f"c4-{split}.*.json*")
    elif split == "train":
        pattern = task.dataset
    else:
        pattern = task.dataset.replace("train", "validation")
    files = sorted(glob.glob(str(Path(pattern).expanduser())))
    if not files:
        raise UserError(
            f"task.dataset: no {split} shards match '{pattern}' (expected C4 json or json.gz files "
            f"like c4-{split}.00000-of-01024.json.gz; set task.dataset to their folder or a glob"
            f"{', and task.validation to the validation glob' if split == 'validation' else ''})"
        )
    return files


def open_documents(task: TaskConfig, split: str) -> Any:
    """A `datasets.IterableDataset` of {'text': ...} in the source's own order."""
    if task.dataset != "c4":
        return open_files(task, _files(task, split), split)
    _hub_reachable()
    return _open(task, split, {"path": "allenai/c4", "name": "en", "split": split})


def _hub_reachable() -> None:
    reason = offline()
    if reason:  # a stream is read from the hub as it goes: a cache cannot stand in
        raise UserError(f"task.dataset: 'c4' streams allenai/c4 from the Hugging Face hub, "
                        f"which cannot be reached ({reason}); {LOCAL_C4}")


def _files(task: TaskConfig, split: str) -> list[str]:
    """A local source's files in order; the hub's C4 training files by name."""
    if task.dataset == "c4":
        _hub_reachable()
        return [f"{C4_HUB}/c4-train.{i:05d}-of-{C4_TRAIN_FILES:05d}.json.gz"
                for i in range(C4_TRAIN_FILES)]
    if task.dataset == "sample":
        return [str(SAMPLE / f"c4-{split}.00000-of-00001.json.gz")]
    return _local_files(task, split)


def open_files(task: TaskConfig, files: list[str], split: str = "train") -> Any:
    """`files` (local paths or hub URLs) as one `datasets.IterableDataset`, read in order."""
    return _open(task, split, {"path": "json", "data_files": files, "split": "train"})


def _open(task: TaskConfig, split: str, args: dict[str, Any]) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(streaming=True, **args).select_columns(["text"])
    except Exception as e:  # unreachable hub, bad files: the user must point at local data
        reason = brief(e)
        raise UserError(
            f"task.dataset: cannot open '{task.dataset}' {split} split ({reason}); {LOCAL_C4}"
        ) from None


class Packer:
    """Documents into `seq_len` blocks: packed with EOS between them, or truncated and padded."""

    def __init__(self, task: TaskConfig, tokenizer: Any) -> None:
        self.task = task
        self.eos = np.asarray([tokenizer.eos_token_id], dtype=np.int32)
        pad = tokenizer.pad_token_id
        self.pad = tokenizer.eos_token_id if pad is None else pad
        self.carry = np.zeros(0, dtype=np.int32)

    def block(self, next_doc: Callable[[], np.ndarray]) -> tuple[np.ndarray, int]:
        """(tokens of length seq_len, count of real tokens): fewer only when padding."""
        n = self.task.seq_len
        if not self.task.packing:
            doc = np.concatenate([next_doc(), self.eos])[:n]
            return np.concatenate([doc, np.full(n - len(doc), self.pad, dtype=np.int32)]), len(doc)
        while len(self.carry) < n:
            self.carry = np.concatenate([self.carry, next_doc(), self.eos])
        block, self.carry = self.carry[:n], self.carry[n:]
        return block, n


class BlockStream:
    """Training blocks in a seeded order; `state()` and `restore()` make the position exact."""

    def __init__(self, task: TaskConfig, tokenizer: Any, seed: int,
                 tokenize: SplitTokenizer | None = None) -> None:
        """`tokenize`: data parallel, this rank's share of the tokenizing (harness/data/split.py);
        every rank then holds the same stream, and the same state."""
        self.task = task
        self.tok = tokenizer
        self.tokenize = tokenize or SplitTokenizer(tokenizer)
        self.rng = random.Random(seed)
        self.epoch = 0
        self.buffer: list[str | np.ndarray | int] = []  # read_shards: stream positions
        self.ready: list[np.ndarray] = []  # drawn and tokenized ahead, not yet packed
        self.packer = Packer(task, tokenizer)
        self.shards = self._sharded() if task.read_shards else None
        self.docs = None if self.shards else open_documents(task, "train")
        self._docs_iter: Iterator[dict[str, Any]] | None = None

    def _sharded(self) -> ShardedDocs:
        """This rank's read shards (harness/data/shards.py); its tokenizer splits by owner."""
        split = self.tokenize.split
        rank, world = (self.tokenize.rank, self.tokenize.world) if split else (0, 1)
        files = _files(self.task, "train")
        n = self.task.read_shards or 1
        check(n, len(files), world, self.task.dataset)
        self.tokenize.owned()
        return ShardedDocs(files, n, rank, world, lambda part: open_files(self.task, part))

    def state(self) -> dict[str, Any]:
        """The position; under read_shards with several ranks, this rank's part of it
        (`whole` joins them)."""
        return {
            "reader": self.shards.state() if self.shards else copy.deepcopy(
                self.docs.state_dict()),
            "epoch": self.epoch,
            "rng": self.rng.getstate(),
            "buffer": list(self.buffer),
            "carry": self.packer.carry.copy(),
            "ready": list(self.ready),
        }

    def whole(self, state: dict[str, Any], group: Any = None) -> dict[str, Any]:
        """`state` with every rank's shards and texts under read_shards: the position that
        restores at any world size. A collective over `group` (default: all ranks) when this
        rank's holds its own alone: every rank calls it at the same position."""
        if self.shards is None or self.shards.whole(state["reader"]):
            return state
        parts: list[Any] = [None] * self.shards.world
        dist.all_gather_object(parts, state["reader"], group=group)
        return {**state, "reader": merge(parts)}

    def restore(self, state: dict[str, Any]) -> None:
        if self.shards:
            self.shards.restore(state["reader"])
        else:
            if state["epoch"] != self.epoch:
                self.docs = open_documents(self.task, "train")
            self.docs.load_state_dict(state["reader"])
        self._docs_iter = None
        self.epoch = state["epoch"]
        self.rng.setstate(state["rng"])
        self.buffer = list(state["buffer"])
        self.packer.carry = state["carry"].copy()
        self.ready = list(state.get("ready", []))  # states written before it: none

    def _read_chunk(self) -> list[str] | list[int]:
        if self.shards:  # shards are read pass after pass: never short
            return self.shards.read(READ_CHUNK)
        texts: list[str] = []
        for _ in range(2):  # at most one restart per call: an empty corpus must not spin
            if self._docs_iter is None:
                self._docs_iter = iter(self.docs)
            for row in self._docs_iter:
                texts.append(row["text"])
                if len(texts) == READ_CHUNK:
                    return texts
            if texts:
                return texts
            self.epoch += 1
            self.docs = open_documents(self.task, "train")
            self._docs_iter = None
        raise UserError(f"task.dataset: '{self.task.dataset}' has no training documents")

    def _draw(self) -> str | np.ndarray | int:
        """The buffer holds raw texts, tokenized when drawn: filling 1000 documents then costs
        a read, not 2 s of tokenization before a trial's first step (the sample corpus, 2 cores).
        A token array in it comes from a checkpoint written before that and is used as it is."""
        while len(self.buffer) < self.task.shuffle_buffer:
            chunk = self._read_chunk()
            self.buffer.extend(chunk)
            if len(chunk) < READ_CHUNK:
                break  # end of an epoch: draw from what the buffer holds
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def _next_document(self) -> np.ndarray:
        """Drawn `tokenize.batch` at a time (one in one process): which documents are drawn
        depends on the seed and the texts only, so drawing ahead leaves the stream as it was."""
        if not self.ready and self.shards:
            self.ready = self.tokenize.by_owner(*self.shards.take(
                [int(self._draw()) for _ in range(self.tokenize.batch)]))
        if not self.ready:
            drawn = [self._draw() for _ in range(self.tokenize.batch)]
            ids = iter(self.tokenize([d for d in drawn if isinstance(d, str)]))
            self.ready = [d if isinstance(d, np.ndarray) else next(ids) for d in drawn]
        return self.ready.pop(0)

    def next_block(self) -> tuple[np.ndarray, int]:
        return self.packer.block(self._next_document)

    def end(self) -> None:
        """This rank stops reading (the other ranks are told at their next exchange)."""
        self.tokenize.end()


def eval_blocks(task: TaskConfig, tokenizer: Any, tokens: int,
                tokenize: SplitTokenizer | None = None) -> list[tuple[np.ndarray, int]]:
    """The first `tokens` validation targets in file order: the same for every method and trial.
    `tokenize`: data parallel, this rank's share of the tokenizing, as for training."""
    docs = iter(open_documents(task, "validation"))
    packer = Packer(task, tokenizer)
    tokenize = tokenize or SplitTokenizer(tokenizer)
    ready: list[np.ndarray] = []

    def next_doc() -> np.ndarray:
        if not ready:
            ready.extend(tokenize([row["text"] for row in itertools.islice(docs, tokenize.batch)]))
        if not ready:
            raise StopIteration  # the split is read to its end
        return ready.pop(0)

    blocks: list[tuple[np.ndarray, int]] = []
    counted = 0
    try:
        while counted < tokens:
            block, valid = packer.block(next_doc)
            blocks.append((block, valid))
            counted += valid - 1
    except StopIteration:
        if not blocks:
            raise UserError(f"task.dataset: '{task.dataset}' has no validation documents") from None
    return blocks
