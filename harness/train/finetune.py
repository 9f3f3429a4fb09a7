"""GLUE fine-tuning as the loop sees it: a classifier (or STS-B regressor), batches of
tokenized examples in seeded epochs, and the task's metrics on its validation split(s)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness import distributed
from harness.config import RunConfig
from harness.config.steps import Steps
from harness.data.glue import GlueTask, compute_metrics, get_task, load_split
from harness.errors import UserError
from harness.modifiers.precision import Precision
from harness.train.classifier import build_classifier

Batch = dict[str, torch.Tensor]  # input_ids, attention_mask, labels


def loss_sum(
    model: nn.Module, batch: Batch, regression: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss over the batch's examples, logits)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits.float()
    if regression:
        return F.mse_loss(logits.squeeze(-1), batch["labels"].float(), reduction="sum"), logits
    return F.cross_entropy(logits, batch["labels"], reduction="sum"), logits


def build(run: RunConfig) -> tuple[nn.Module, Any]:
    return build_classifier(run, get_task(run.task.glue_task).num_labels)


class GlueData:
    """The training split as a stream of seeded permutations, one per epoch; micro-batch g
    holds examples g·b … g·b+b−1 of that stream, and under DDP rank r takes g ≡ r (mod W), so
    the ranks together see what one process would. An epoch is the floor of n / total batch.
    Training examples are tokenized as a micro-batch takes them (each independently: the
    same ids as the whole split's), so a rank tokenizes only its share; the validation
    split(s), which every rank scores whole, are tokenized once."""

    def __init__(self, run: RunConfig, tok: Any, device: torch.device, steps: Steps) -> None:
        self.run, self.tok, self.device, self.steps = run, tok, device, steps
        self.task: GlueTask = get_task(run.task.glue_task)
        self.regression = self.task.num_labels == 1
        self.train = self._texts(load_split(self.task, run.task.dataset, "train"))
        self.validation = {
            split: self._encode(self._texts(load_split(self.task, run.task.dataset, split)))
            for split in self.task.validation
        }
        total = steps.sequences
        self.steps_per_epoch = len(self.train["label"]) // total
        if self.steps_per_epoch == 0:
            raise UserError(f"train.total_batch_size {total} is larger than the "
                            f"{len(self.train['label'])} training examples of {self.task.name}")
        self.cursor = 0  # this rank's micro-batches taken so far
        self._orders: dict[int, np.ndarray] = {}

    def _texts(self, data: Any) -> dict[str, Any]:
        return {"texts": [list(data[c]) for c in self.task.columns],
                "label": np.asarray(data["label"])}

    def _tokenize(self, split: dict[str, Any], rows: np.ndarray) -> list[list[int]]:
        texts = [[column[i] for i in rows] for column in split["texts"]]
        return self.tok(*texts, truncation=True, max_length=self.run.task.seq_len)["input_ids"]

    def _encode(self, split: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": self._tokenize(split, np.arange(len(split["label"]))),
                "label": split["label"]}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.train["label"])
            self._orders = {epoch: np.random.default_rng([self.run.seed, epoch]).permutation(n)}
        return self._orders[epoch]

    def _batch(self, ids: list[list[int]], labels: np.ndarray) -> Batch:
        longest = self.run.task.padding == "longest"
        width = max(map(len, ids)) if longest else self.run.task.seq_len
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        dtype = torch.float32 if self.regression else torch.long
        labels = torch.as_tensor(labels, dtype=dtype)
        return {k: v.to(self.device) for k, v in
                (("input_ids", input_ids), ("attention_mask", mask), ("labels", labels))}

    def next(self) -> tuple[Batch, int]:
        b, n = self.steps.micro_batch, len(self.train["label"])
        g = self.cursor * self.steps.world + distributed.rank()
        self.cursor += 1
        positions = np.arange(g * b, (g + 1) * b)
        epochs = positions // n  # a batch may straddle two epochs
        rows = np.concatenate([self._order(int(e))[positions[epochs == e] % n]
                               for e in np.unique(epochs)])
        batch = self._batch(self._tokenize(self.train, rows), self.train["label"][rows])
        return batch, int(batch["attention_mask"].sum())

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(len(batch["labels"]), device=self.device)

    def loss(self, net: nn.Module, batch: Batch) -> torch.Tensor:
        return loss_sum(net, batch, self.regression)[0]

    def state(self) -> Any:
        return {"cursor": self.cursor}

    def restore(self, state: Any) -> None:
        self.cursor = state["cursor"]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, precision: Precision,
                 lockstep: bool = False) -> dict[str, float]:
        """Every rank scores the whole validation set (small), so all agree without gathers
        (and run as many forwards, as fsdp's `lockstep` needs)."""
        out: dict[str, float] = {}
        for i, (split, data) in enumerate(self.validation.items()):
            prefix = "eval_" if i == 0 else f"eval_{split.removeprefix('validation_')}_"
            total, outputs = 0.0, []
            batch_size = self.run.eval.batch_size or self.run.train.batch_size
            for start in range(0, len(data["label"]), batch_size):
                rows = np.arange(start, min(start + batch_size, len(data["label"])))
                batch = self._batch([data["input_ids"][i] for i in rows], data["label"][rows])
                with precision.autocast():
                    loss, logits = loss_sum(model, batch, self.regression)
                total += float(loss)
                outputs.append(logits.squeeze(-1) if self.regression else logits.argmax(-1))
            predictions = torch.cat(outputs).cpu().numpy()
            metrics = compute_metrics(self.task, predictions, data["label"])
            out.update({f"{prefix}{k}": v for k, v in metrics.items()})
            out[f"{prefix}loss"] = total / len(data["label"])
        return out

    def close(self) -> None:
        """Nothing runs in the background."""
