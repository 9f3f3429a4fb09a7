"""One trial's training: the loop, its lifecycle, and the tasks it runs."""

from harness.train.loop import NonFinite, Pruned, Trainer
from harness.train.run import train

__all__ = ["NonFinite", "Pruned", "Trainer", "train"]
