"""The same arithmetic on every strategy: every method that trains data-parallel, under ddp and
fsdp, on 2 and 4 processes, in 32-true and bf16-mixed, with and without accumulation, ends as
one process does: each step's loss and the eval loss, the final weights and the optimizer's
states. One launch a world size trains every case in turn (tests/train/equality_ranks.py); the
one-process references run here, on the test's one thread.

What remains is the order of sums: a reduce-scatter over W ranks instead of one process's
sums, and fsdp's clipping norm summed from shards (a float32 ulp in the clip coefficient).
bf16-mixed rounds each weight to bfloat16 in every matmul, so a weight 1e-7 away rounds to the
neighbouring bfloat16 value now and then and the loss moves further. The bounds are the
measured spread with room (docs/scale-out.md, "Equality with one process")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import free_port, micro_run, write_yaml
from equality_ranks import measure
from method_matrix import METHODS, MODEL_METHODS
from ranks import Ranks

from harness.errors import UserError
from harness.methods.resolve import load_run

PRECISIONS = ("32-true", "bf16-mixed")
# Relative, on each step's loss and the eval loss: 32-true is DDP's own bound (measured
# 2.2e-7, Muon 3.8e-6), bf16-mixed twice the largest measured (4.8e-5, over 6 steps)
LOSS_RTOL = {"32-true": 1e-5, "bf16-mixed": 1e-4}
# Absolute, on the final weights; see tests/train/test_fsdp.py's WEIGHT_ATOL for why each
# (measured over 6 steps: GaLore 4.9e-5, APOLLO 3.7e-5, Fira 8.9e-5, Q-GaLore 3.2e-4, ReLoRA
# 6.0e-4, 8-bit Adam 4.8e-4 (2.6e-3 after 12 steps), Muon 3.4e-3; others 1.3e-5)
WEIGHT_ATOL = {"galore": 3e-4, "apollo": 2e-4, "fira": 3e-4, "qgalore": 1e-3, "relora": 3e-3,
               "adam8bit": 4e-3, "muon": 2e-2,
               # Lion: an interpolation near 0 whose sign the sums' order flips steps that
               # weight 2·lr the other way (measured 4.7e-3 over 4 steps; 4 steps of 2·lr)
               "lion": 2.4e-2,
               # 4-bit Adam: a value near a code's edge that the sums' order rounds to the
               # neighbouring one of 16 codes (measured 1.9e-3 over 4 steps, lm_head)
               "adam4bit": 6e-3,
               # low-rank under fsdp in 32-true: one element of lm_head 6.4e-5 off over 4
               # steps (its factors' products summed in another order)
               "lowrank": 2e-4,
               # Schedule-Free: measured 4.9e-5 over 4 steps, at the default's edge
               "schedule_free": 1e-4,
               # FRUGAL: signSGD on the residual G − PPᵀG, whose entries near 0 the sums'
               # order flips, each 2·lr the other way (measured 6.0e-3 over 4 steps, ddp)
               "frugal": 2.4e-2,
               # NorMuon: Muon's bfloat16 Newton–Schulz on inputs the sums' order moved
               # (measured 8.0e-3 over 4 steps, fsdp bf16-mixed; Muon's bound)
               "normuon": 2e-2,
               # SOAP: the eigenvectors of nearly equal eigenvalues of L and R (and of the zero
               # ones where a step has fewer tokens than a side) turn with the sums' order, and
               # Adam's ratio M/√V in a turned basis, V near 0 there, is another step: this
               # checks that ddp trains, not that it is equal (measured 0.71 over 4 steps with a
               # refresh every 2, ddp 32-true; 1.3e-2 without refreshes)
               "soap": 1.0}
# Sign steps on every entry (FRUGAL's state-free part): flipped signs move the loss and the
# last gradient norm more than rounding does. Relative (loss, grad norm); measured over 4
# steps: 2.2e-4 and 5.6e-3 (fsdp bf16-mixed), 7.1e-6 and 8.2e-4 (ddp 32-true)
SIGN_RTOL = {"frugal": (1e-3, 2e-2),
             # SOAP's turned bases (WEIGHT_ATOL): measured 2.5e-4 and 1.6e-3 (ddp)
             "soap": (1e-3, 1e-2)}
# CAME in bf16-mixed: its step divides by a factored EMA of the instability (u − m)², a
# difference of near-equal values, so the neighbouring-bfloat16 roundings below move its loss
# and gradients about ten times AdamW's. Relative (loss, grad norm), measured over 4 steps:
# fsdp on 2 processes 7.2e-4 and 2.2e-3; one process against itself with its micro-batches
# summed in another order up to 1.4e-3 and 1.0e-2 (AdamW 3.5e-5 and 3.2e-3)
BF16_RTOL = {"came": (3e-3, 2e-2)}
# bf16-mixed: a weight rounded to the neighbouring bfloat16 value turns into Adam steps of up
# to about lr apart (measured 1.1e-2 over 6 steps; 4 steps of 2·lr: 2.4e-2)
BF16_WEIGHT_ATOL = 3e-2
# Relative, on the last step's gradient norm: float32 sums of 1.1M squares in another order;
# bf16-mixed: the gradients of weights a rounding moved (measured up to 2.0e-3, ReLoRA with its
# reset under fsdp, APOLLO-Mini 1.7e-3: which bfloat16 values a rounding moves depends on the
# CPU's kernels, so twice that)
NORM_RTOL = {"32-true": 2e-4, "bf16-mixed": 4e-3}
# ReLoRA's magnitude prune keeps an entry's exp_avg where it zeroes its exp_avg_sq, so the step
# after a merge is about lr·m/|g| with g a fresh gradient near 0: bf16's rounding of g moves a
# weight by up to 0.5 (one process against itself, lr 1e-7 apart, alike). Its bf16-mixed fsdp
# case resets the moments whole; the prune is checked in 32-true.
VARIANTS = {"galore_layerwise": ("galore", {}),
            "relora_reset": ("relora", {"optimizer_reset": "full"})}
# Methods whose ddp run is not one process's optimizer on averaged gradients: those that change
# the model (DDP wraps what their `prepare` made) or step inside backward (DDP's hooks).
DDP_PATHS = {*MODEL_METHODS, "galore_layerwise"}


def config(method: str, parallel: str, precision: str, accumulate: bool,
           world: int) -> dict[str, Any] | None:
    """4 steps of 2 or (accumulating) 4 micro-batches of 2 sequences on every rank; None when
    the strategy refuses the method."""
    layerwise = method == "galore_layerwise"  # unclipped: low-rank sums between micro-batches
    data = micro_run(steps=4, total_batch_size=2 * world * (2 if accumulate else 1),
                     parallel=parallel, precision=precision,
                     **({"grad_clip": None} if layerwise else {}))
    kernel, settings = VARIANTS.get(method, (method, {}))
    data.update(eval={"every": 0, "tokens": 256}, method={**METHODS[kernel], **settings},
                memory={"layerwise": layerwise})
    try:
        load_run(data)
    except UserError:
        return None
    return data


def diagonal(world: int) -> list[tuple[str, str, str, bool]]:
    """Each method under fsdp (ddp where fsdp refuses it) in one precision, with or without
    accumulation, and under ddp in the other precision and the other accumulation, the
    precisions and accumulations in turn over the methods (4 processes: a few methods);
    2 processes: ReLoRA under fsdp in bf16-mixed too, its moments reset whole (VARIANTS), and
    CAME, whose bf16-mixed bounds are its own (BF16_RTOL).

    On 2 processes, no ddp case for a method that keeps the model as built and steps after
    backward (not in DDP_PATHS) where fsdp takes it: DDP hands its optimizer the gradients
    averaged, whole, so it steps as in one process (its Rows are unsharded); that the average
    is one process's gradient is each kept ddp case's (AdamW's and every model-changing
    method's, both precisions, both accumulations: test_the_diagonal_keeps_ddp_on_every_path),
    and the optimizer under gradients summed in another order is its own fsdp case's. The
    whole matrix: scripts/equality_table.py."""
    methods = [*METHODS, "galore_layerwise"] if world == 2 else \
        ["full", "galore_layerwise", "adam8bit", "muon", "fira", "adam_mini"]
    cases = []
    for i, method in enumerate(methods):
        precision, other = PRECISIONS[i % 2], PRECISIONS[1 - i % 2]
        accumulate = i // 2 % 2 == 0
        first = "fsdp" if config(method, "fsdp", precision, accumulate, world) else "ddp"
        cases.append((method, first, precision, accumulate))
        if first == "ddp" or method in DDP_PATHS or world == 4:  # 4: ddp's accumulation
            cases.append((method, "ddp", other, not accumulate))
    return cases + ([("relora_reset", "fsdp", "bf16-mixed", True),
                     ("came", "fsdp", "bf16-mixed", False)] if world == 2 else [])


@pytest.mark.parametrize("world", [2, 4])
def test_the_diagonal_keeps_ddp_on_every_path(world):
    """Every method (and variant) trains on `world` processes; ddp and fsdp each in both
    precisions, with and without accumulation; ddp with every method that changes the model
    or steps in backward, and with every one fsdp refuses."""
    cases = diagonal(world)
    methods = [*METHODS, "galore_layerwise"] if world == 2 else ["full", "galore_layerwise"]
    assert {m for m, *_ in cases} >= set(methods)
    for parallel in ("ddp", "fsdp"):
        assert {(x, a) for _, p, x, a in cases if p == parallel} == {
            (x, a) for x in PRECISIONS for a in (True, False)}, parallel
    on_ddp = {m for m, p, *_ in cases if p == "ddp"}
    on_fsdp = {m for m, p, *_ in cases if p == "fsdp"}
    assert on_ddp >= {m for m in DDP_PATHS if m in methods} | {
        m for m, *_ in cases if m not in on_fsdp}


def close(a: Any, b: Any, atol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


# Quantized weights (Q-GaLore's INT8 codes): a weight near a code's edge that the sums' order
# rounds to the neighbouring code, as 8-bit and 4-bit moments do (measured: 1 of 11,264 entries
# one code apart, ddp bf16-mixed over 4 steps; 0 in most runs): at most one code, on at most
# ten times that share of a tensor's entries
CODE_SHARE = 1e-3


def near_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    apart = (a - b).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() <= CODE_SHARE, (
        f"{int((apart > 0).sum())} of {apart.numel()} codes apart, by up to {apart.max():.0f}")


def spread(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> float:
    """The largest absolute difference over `keys` (0 where a shape differs: asserted apart)."""
    return max([float((a[k].float() - b[k].float()).abs().max()) for k in keys
                if k in a and a[k].shape == b[k].shape and a[k].numel()], default=0.0)


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_trains_as_one_process_on_every_strategy(tmp_path, world):
    cases = diagonal(world)
    paths = [write_yaml(tmp_path / f"{m}-{p}-{x}-{'acc' if a else 'one'}.yaml",
                        config(m, p, x, a, world)) for m, p, x, a in cases]
    launch = Ranks([str(p) for p in paths], world, free_port(), "equality_ranks")
    references = [measure(load_run(config(*case, world))) for case in cases]
    log, _ = launch.communicate(timeout=900)
    assert launch.returncode == 0, log
    rows, checks = [], []
    for (method, parallel, precision, _), path, one in zip(cases, paths, references,
                                                          strict=True):
        many = torch.load(path.with_suffix(".pt"))
        got, want = [*many["losses"], many["eval"]], [*one["losses"], one["eval"]]
        kernel = VARIANTS.get(method, (method,))[0]
        moments = [k for k in one["states"] if k.endswith("exp_avg")
                   # SOAP: the gradients of weights its turned bases moved (WEIGHT_ATOL)
                   and kernel not in ("adam8bit", "adam4bit", "muon", "came", "frugal", "soap")]
        # 8-bit codes; Muon's momentum; CAME's, of RMS-normalized updates (values near 1,
        # measured 2.3e-5 relative under fsdp): their weights are bound, not the 2e-6 here
        losses = max(abs(a - b) / b for a, b in zip(got, want, strict=True))
        norm = (many["grad_norm"] or 0) / (one["grad_norm"] or 1) - 1
        rows.append(f"{path.stem}: losses {losses:.1e}, weights "
                    f"{spread(many['weights'], one['weights'], list(one['weights'])):.1e}, "
                    f"moments {spread(many['states'], one['states'], moments):.1e}, "
                    f"grad norm {abs(norm):.1e}")
        checks.append((many, one, got, want, method, parallel, precision, moments))
    print("\n".join(rows))
    for (many, one, got, want, method, parallel, precision, moments), row in zip(checks, rows,
                                                                                strict=True):
        kernel = VARIANTS.get(method, (method,))[0]
        loss_rtol, norm_rtol = SIGN_RTOL.get(kernel, (0, 0))
        if precision == "bf16-mixed":
            loss_rtol, norm_rtol = BF16_RTOL.get(kernel, (loss_rtol, norm_rtol))
        assert got == pytest.approx(want, rel=max(LOSS_RTOL[precision], loss_rtol), abs=0), row
        atol = max(WEIGHT_ATOL.get(kernel, 5e-5),
                   BF16_WEIGHT_ATOL if precision == "bf16-mixed" else 0)
        assert many["weights"].keys() == one["weights"].keys()
        for key, value in one["weights"].items():
            if key in one["codes"]:
                near_codes(many["weights"][key], value)
            else:
                close(many["weights"][key], value, atol)
        assert many["states"].keys() == one["states"].keys()
        for key, value in one["states"].items():
            assert many["states"][key].shape == value.shape, (row, key)
        for key in moments:  # AdamW's first moments: the gradients' spread
            close(many["states"][key], one["states"][key],
                  2e-6 if precision == "32-true" else 1e-3)
        if one["grad_norm"] is None:  # layer-wise: each gradient used and freed in backward
            assert many["grad_norm"] is None and (kernel != method or kernel == "qgalore")
        else:  # over every rank's shards, as one process's over its gradients
            assert many["grad_norm"] == pytest.approx(
                one["grad_norm"], rel=max(NORM_RTOL[precision], norm_rtol))
            assert many["grad_norm"] > 0
        if parallel == "fsdp":  # rank 0 holds its rows of each weight: ceil(m / W) of m
            held = sum(-(-s[0] // world) * (s.numel() // s[0])
                       for s in (w.shape for w in one["weights"].values()))
            assert many["param_bytes"] == 4 * held
