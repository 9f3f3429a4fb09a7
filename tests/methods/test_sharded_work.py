"""Sharded optimizer work (harness/distributed/owners.py): under fsdp Muon's Newton–Schulz and
GaLore's SVD refreshes run once per matrix, on one rank each, so what a rank spends on them
shrinks as 1/W. Counted in one training step of llama_micro at 1, 2 and 4 ranks
(tests/methods/sharded_work.py, one launch per world size), by hand against the shapes:

- hidden matrices a layer, two layers: q, k, v, o 64×64; gate, up 176×64; down 64×176.
  Newton–Schulz (5 steps, on a×b with a ≤ b): 5·(4a²b + 2a³) flops, 7,864,320 for 64×64 and
  17,039,360 for 176×64, F = 2·(4·7,864,320 + 3·17,039,360) = 165,150,720 a step.
- GaLore (rank 8) projects all 14: an SVD costs m·n·min(m, n), S = 2·(4·64³ + 3·176·64²) =
  6,422,528; its bases: q, k, v, o, gate, up a right Q (8×64, whole on every rank), down a
  left P (64×8, a rank keeps its 64/W rows): 4·(12·512 + 2·512/W) bytes in float32; down's
  two 8×176 moments a rank keeps by rows of the 8: 2·2·(8/W)·176·4 = 22,528/W bytes. The
  estimator (`harness.cost.estimate.estimate_run`) gives rank 0's bases and states as counted.

Bounds: every matrix is computed exactly once (the ranks' sum is the 1-rank count), the
busiest rank at most C = 1.25 times an even share; measured 1.0 (2 ranks) and 1.016 (4) for
the step of all matrices, balanced by cost, and up to 1.21 layer-wise, where each hook's matrix
goes to the next rank in turn. Bytes a rank sends or receives: one all-to-all each way; with
an even share, a trip of matrices of B bytes costs a rank 2·B·(W−1)/W² (its rows of the others'
out, the others' rows of its own in), also held to C times that. GaLore's second trip brings
every rank each right basis Q whole (replicated: Q_tot, not shrinking with W) and its rows of
each P, with two flags a weight, held to 2·(Q_tot + flags) + C·2·P_tot/W.

Every run also trains 3 steps of 8 sequences at each world size, its losses within fsdp's 1e-5
of the 1-rank run's; one GaLore run refreshes every step with `moments: reproject` at rank 2, so
over 4 ranks two hold no rows of a left side's R (measured: within 3.4e-6, Muon's bf16 rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port, micro_run, write_yaml
from ranks import Ranks

from harness.cost.estimate import estimate_run
from harness.distributed import owners
from harness.methods.resolve import load_run

C = 1.25
F = 2 * (4 * 5 * (4 * 64**2 * 64 + 2 * 64**3) + 3 * 5 * (4 * 64**2 * 176 + 2 * 64**3))
S = 2 * (4 * 64**3 + 3 * 176 * 64 * 64)
HIDDEN = 2 * (4 * 64 * 64 + 3 * 176 * 64)  # elements of the hidden matrices
Q_TOT, P_TOT, FLAGS = 4 * 12 * 8 * 64, 4 * 2 * 64 * 8, 4 * 2 * 14  # bytes, float32
GALORE = {"name": "galore", "rank": 8, "update_proj_gap": 50}
LAYERWISE = {"layerwise": True}
# rank 2 over 4 ranks: two of them hold no rows of a left side's R; a new basis every step,
# the moments rotated into it
REPROJECT = {"name": "galore", "rank": 2, "update_proj_gap": 1, "moments": "reproject"}
CONFIGS = {"muon": ({"name": "muon"}, {}), "muon-layerwise": ({"name": "muon"}, LAYERWISE),
           "galore": (GALORE, {}), "galore-layerwise": (GALORE, LAYERWISE),
           "galore-reproject": (REPROJECT, {})}
COUNTED = ("muon", "muon-layerwise", "galore", "galore-layerwise")


def config(world: int, name: str) -> dict:
    method, memory = CONFIGS[name]
    return {**micro_run(total_batch_size=8, parallel="fsdp"), "method": method,
            "memory": memory}  # 8 sequences a step in micro-batches of 2 at every world size


def counted(tmp_path: Path, world: int) -> dict[str, list[dict]]:
    """Each config's lines, one a rank, from one launch of `world` ranks."""
    folder = tmp_path / str(world)
    paths = [write_yaml(folder / f"{name}.yaml", config(world, name)) for name in CONFIGS]
    done = Ranks([str(folder), *map(str, paths)], world, free_port(), "sharded_work")
    log, _ = done.communicate(timeout=600)
    assert done.returncode == 0, log
    lines = [json.loads(line) for p in folder.glob("rank-*.jsonl")
             for line in p.read_text().splitlines()]
    return {name: sorted((x for x in lines if x["config"] == name), key=lambda x: x["rank"])
            for name in CONFIGS}


def trip(bytes_: int, world: int) -> float:
    """What a trip of `bytes_` costs a rank with an even share: 2·B·(W−1)/W²."""
    return 2 * bytes_ * (world - 1) / world**2


def test_a_ranks_newton_schulz_and_svd_work_shrinks_as_one_over_the_ranks(tmp_path):
    """Also: each run's losses over its 3 steps are the 1-rank run's, within fsdp's 1e-5
    relative (tests/train/test_fsdp.py)."""
    figures, alone = [], {}
    for world in (1, 2, 4):
        runs = counted(tmp_path, world)
        for name, ranks in runs.items():
            losses = ranks[0]["losses"]
            alone.setdefault(name, losses)
            assert losses == pytest.approx(alone[name], rel=1e-5, abs=0), (name, world)
            if name not in COUNTED:
                continue
            assert len(ranks) == world, name
            assert all(r["pickled"] == 0 for r in ranks), name  # bases travel as tensors
            flops = [r["ns_flops"] for r in ranks]
            svds = [r["svd_flops"] for r in ranks]
            total = F if name.startswith("muon") else S
            work = flops if name.startswith("muon") else svds
            assert sum(work) == total, (name, world, work)  # each matrix once, on one rank
            assert max(work) <= C * total / world, (name, world, work)
            figures.append(f"{name} W={world}: per rank {work}, all-to-all bytes "
                           f"{[r['trips'] for r in ranks]}")
            if world == 1:
                assert all(not r["trips"] for r in ranks)
                continue
            for r in ranks:
                if name.startswith("muon"):  # bfloat16 both ways: 2 bytes a value
                    assert sum(r["trips"]) <= C * 2 * trip(2 * HIDDEN, world), (name, r)
                elif name == "galore":  # the gradients out, then the bases back
                    out, back = r["trips"]
                    assert out <= C * trip(4 * HIDDEN, world), (name, r)
                    assert back <= 2 * (Q_TOT + FLAGS) + C * 2 * P_TOT / world, (name, r)
                else:  # one matrix a trip
                    assert sum(r["trips"]) <= C * (trip(4 * HIDDEN, world) + 2 * (Q_TOT + FLAGS)
                                                   + 2 * P_TOT / world), (name, r)
        for name in ("galore", "galore-layerwise"):  # rank 0 holds the most rows of P
            first = runs[name][0]
            assert first["extra_bytes"] == Q_TOT + P_TOT // world, name
            assert all(r["left_moments"] == 22_528 // world for r in runs[name]), name
            estimate = estimate_run(load_run(config(world, name)), world)
            assert (estimate["extra_bytes"], estimate["optimizer_state_bytes"]) == \
                (first["extra_bytes"], first["state_bytes"]), name
    print("\n".join(figures))


def test_matrices_go_to_the_least_loaded_rank_costliest_first():
    """Longest-processing-time order: 5 and 4 open the two ranks, each 3 then joins the lighter
    (7 against 5, then 8 against 7, ...): loads 8 and 10."""
    loads = [0, 0]
    assert owners.assign([3, 5, 3, 4, 3], 2, loads) == [1, 0, 0, 1, 1]
    assert loads == [8, 10]


def test_one_matrix_a_call_goes_to_the_rank_with_the_least_work_so_far(monkeypatch):
    """Layer-wise, each hook shares out one matrix: the process's ledger sends it to the rank
    that has done least (ties: the lowest), as one call of all of them would have."""
    monkeypatch.setattr(owners, "_given", {})
    got = [owners.share("test", [cost], 3)[0] for cost in (4, 4, 4, 1, 1, 1, 1, 6)]
    assert got == [0, 1, 2, 0, 1, 2, 0, 1]  # the 6 to rank 1 (0, as rank 2), not 0 (1)
