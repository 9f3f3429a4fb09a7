"""Under fsdp and hsdp a rank holds ceil(m / G) rows of every parameter FSDP shards, the
factors of LoRA, ReLoRA and low-rank included: A (r × in) by its r rows, B (out × r) by its
out rows. The estimate's weight, gradient and AdamW state bytes (`estimate_run`) against those
counted from the real parameters of the prepared model: rows per rank by hand, AdamW's two
float32 moments an element and a 4-byte step counter a trained tensor."""

from __future__ import annotations

import pytest
from conftest import micro_model, micro_run

from harness.cost.estimate import estimate_run
from harness.methods import build_method
from harness.methods.resolve import load_run

METHODS = {"lora": {"name": "lora", "rank": 4},
           "lora_non_targets": {"name": "lora", "rank": 4, "train_non_targets": True},
           "relora": {"name": "relora", "rank": 4, "reset_every": 2, "restart_warmup_steps": 1},
           "lowrank": {"name": "lowrank", "rank": 8}}  # fmt: skip
LAYOUTS = {"fsdp over 4": ({"parallel": "fsdp"}, 4),
           "hsdp 2 x 2": ({"parallel": "hsdp", "shard_group": 2}, 2),
           "fsdp over 8": ({"parallel": "fsdp"}, 8)}  # 8 ranks: a rank-4 A's row on rank 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_each_factor_is_counted_by_the_rows_a_rank_holds(method, layout):
    train, group = LAYOUTS[layout]
    world = 8 if layout == "fsdp over 8" else 4
    run = load_run({**micro_run(total_batch_size=2 * world, **train), "method": METHODS[method]})
    model = build_method(run).prepare(micro_model(None, pad_id=0), run)
    shares = {name: -(-p.shape[0] // group) * (p.numel() // p.shape[0])
              for name, p in model.named_parameters()}
    trained = [shares[name] for name, p in model.named_parameters() if p.requires_grad]
    record = estimate_run(run, world)
    assert record["weight_bytes"] == 4 * sum(shares.values())
    assert record["grad_bytes"] == 4 * sum(trained)
    assert record["optimizer_state_bytes"] == 8 * sum(trained) + 4 * len(trained)
