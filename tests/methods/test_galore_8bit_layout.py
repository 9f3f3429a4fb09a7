"""8-bit GaLore's moments kept by rows must split into whole 256-value blocks on every rank;
where they do not, the refusal names the sharding in use: fsdp over the world, or hsdp's
shard group (the ranks a tensor's rows split over there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.distributed import fsdp
from harness.errors import UserError
from harness.methods.galore_optim import GaLoreOptimizer


def optimizer() -> GaLoreOptimizer:
    """A 176 x 64 weight projected at rank 8: its right side's moments are 176 x 8."""
    weight = nn.Parameter(torch.zeros(176, 64))
    return GaLoreOptimizer([{"params": [weight], "rank": 8}], lr=1e-3, inner="adam8bit",
                           min_8bit_size=256)


@pytest.fixture
def sharded(monkeypatch):
    monkeypatch.setattr(GaLoreOptimizer, "sharded", property(lambda self: True))
    return monkeypatch


def test_under_hsdp_the_refusal_names_hsdp_and_its_shard_group(sharded):
    """4 processes as 2 groups of 2: 88 x 8 rows a rank, 2.75 blocks."""
    sharded.setenv("WORLD_SIZE", "4")
    sharded.setattr(fsdp, "shard_ranks", lambda: (2, 0))
    with pytest.raises(UserError) as refused:
        optimizer()
    assert str(refused.value) == (
        "optimizer adam8bit with train.parallel hsdp on 4 processes (train.shard_group 2): "
        "the (176, 8) moments of a (176, 64) weight do not split into equal whole numbers of "
        "256-value blocks, which 8-bit states quantize; use a train.shard_group that divides "
        "their rows so, or train.parallel: ddp")


def test_under_fsdp_the_refusal_names_the_world_size(sharded):
    """3 processes: 176 rows do not split in 3."""
    sharded.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match=r"^optimizer adam8bit with train\.parallel fsdp on 3 "
                       r"processes: the \(176, 8\) moments .* use a world size that divides"):
        optimizer()

