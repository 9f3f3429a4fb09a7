"""Multi-tensor updates (train.update_chunk, harness/modifiers/multi_tensor.py): bf16-true's
float32 updates by chunks give the bits of the one-parameter-at-a-time path (update_chunk 0)
for every compensation, with and without decoupled decay, float32 and bfloat16 moments, over
several steps, for full's AdamW and every method's unprojected update path; a chunk's
temporaries are bounded by the chunk; one step of the Trainer dispatches about as many
operators as a bare loop."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import micro_run
from torch.utils._python_dispatch import TorchDispatchMode

from harness.methods.apollo_optim import APOLLOOptimizer
from harness.methods.fira import FiraOptimizer
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.resolve import load_run
from harness.modifiers.compensation import AdamW
from harness.modifiers.multi_tensor import chunks, update_chunk
from harness.train.build import build_model
from harness.train.loop import Trainer
from harness.trials import Records

BF16 = torch.bfloat16
MODES = ("none", "stochastic_rounding", "kahan")
# shapes cut across chunks of 37 and 500 elements, and two that fit whole in one
SHAPES = ((64, 33), (7,), (300,), (48, 40), (5, 5), (1000,))
CHUNKS = (1 << 24, 500, 37)


class Ops(TorchDispatchMode):
    """Counts the aten operators dispatched, and the largest tensor any of them made that is
    not a view of another (a temporary)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, list | tuple) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s).to(BF16) for s in SHAPES]


def train(params: list[torch.Tensor], opt: torch.optim.Optimizer, steps: int = 4) -> None:
    """`steps` steps on the same gradients for every optimizer; stochastic rounding draws from
    the global generator, seeded the same for each."""
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        opt.step()


def bits(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Weights and every state tensor, as integers: equal only if bitwise equal."""
    out = [p.view(torch.int16).clone() for p in params]
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                out.append(v.view(torch.int16 if v.element_size() == 2 else torch.int32).clone())
    return out


def dispatched(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Operators one more step dispatches."""
    with Ops() as ops:
        train(params, opt, steps=1)
    return ops.total


def assert_same_bits(build: Any, **kwargs: Any) -> None:
    ref_params = weights()
    ref = build(ref_params, update_chunk=0, **kwargs)
    train(ref_params, ref)
    want = bits(ref_params, ref)
    ref_ops = dispatched(ref_params, ref)
    for chunk in CHUNKS:
        params = weights()
        opt = build(params, update_chunk=chunk, **kwargs)
        train(params, opt)
        got = bits(params, opt)
        if chunk == CHUNKS[0]:  # the chunked path ran: fewer operators than weight by weight
            assert dispatched(params, opt) < ref_ops
        assert len(got) == len(want)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), f"update_chunk {chunk} differs"
    assert not torch.equal(want[0], weights()[0].view(torch.int16))  # the weights did move


def adamw(params, wd, **kwargs):
    return AdamW([{"params": params[:3], "weight_decay": wd}, {"params": params[3:]}],
                 lr=1e-2, **kwargs)


@pytest.mark.parametrize(("mode", "wd", "states"),
                         itertools.product(MODES, (0.0, 0.1), ("float32", "bfloat16")))
def test_adamw_by_chunks_has_the_per_parameter_bits(mode, wd, states):
    """full's bf16-true AdamW (and Muon's for its embeddings, head and vectors)."""
    assert_same_bits(adamw, wd=wd, compensation=mode, state_dtype=states)


def low_rank_groups(params, wd):
    return [{"params": [params[0], params[3]], "rank": 8, "weight_decay": wd},
            {"params": [params[i] for i in (1, 2, 4, 5)], "weight_decay": wd}]


def galore(params, wd, **kwargs):
    return GaLoreOptimizer(low_rank_groups(params, wd), lr=1e-2, update_proj_gap=2, **kwargs)


def fira(params, wd, **kwargs):
    return FiraOptimizer(low_rank_groups(params, wd), lr=1e-2, update_proj_gap=2, **kwargs)


def apollo(params, wd, **kwargs):
    return APOLLOOptimizer(low_rank_groups(params, wd), lr=1e-2, update_proj_gap=2, **kwargs)


def apollo_mini(params, wd, **kwargs):
    groups = low_rank_groups(params, wd)
    groups[0]["rank"] = 1
    return APOLLOOptimizer(groups, lr=1e-2, update_proj_gap=2, scale_type="tensor", **kwargs)


# the exact path's (state_dtype, compensation): float32 moments, or bf16 ones with a compensation
EXACT = [(torch.float32, m) for m in MODES] + [(None, "stochastic_rounding"), (None, "kahan")]


@pytest.mark.parametrize("build", [galore, fira, apollo, apollo_mini])
@pytest.mark.parametrize(("states", "mode"), EXACT)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_unprojected_updates_by_chunks_have_the_per_parameter_bits(build, states, mode, wd):
    """GaLore's, Fira's and APOLLO(-Mini)'s unprojected weights, their projected ones beside."""
    assert_same_bits(build, wd=wd, state_dtype=states, compensation=mode)


def test_a_strided_weight_is_updated_whole_with_the_same_bits():
    """A transposed (non-contiguous) weight has no flat view to cut: its chunk holds it whole."""
    def run(chunk: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.randn(64, 33).to(BF16).t(), torch.randn(100).to(BF16)]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, compensation="kahan", update_chunk=chunk)
        train(params, opt)
        return bits(params, opt)

    assert not torch.randn(3, 2).t().is_contiguous()
    for a, b in zip(run(0), run(37), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [0, 1 << 20])
def test_the_runs_update_chunk_reaches_full_and_muons_adamw(chunk):
    """full's bf16-true AdamW, and Muon's for its embeddings, head and vectors (both through
    full's `adamw`), take train.update_chunk; GaLore's from own_optimizer_kwargs."""
    from harness.methods.full import AdamConfig, adamw
    from harness.modifiers.compensation import own_optimizer_kwargs

    run = load_run({**micro_run(precision="bf16-true", update_chunk=chunk)})
    opt = adamw([{"params": weights()}], run, AdamConfig())
    assert isinstance(opt, AdamW) and opt.chunk == chunk
    assert own_optimizer_kwargs(run.train, chunked=True)["update_chunk"] == chunk
    assert "update_chunk" not in own_optimizer_kwargs(run.train)  # Q-GaLore's, INT8 APOLLO's


def test_a_run_that_leaves_the_chunk_gets_its_devices(tmp_path):
    """update_chunk unset: 2^20 elements on a CPU (the bench loop at bf16-true ran 5% faster
    than at 2^24, whose 64 MB temporaries the allocator maps anew each step), 2^24 on a GPU
    (few kernels); the trainer hands this CPU's to the optimizer. A number the run sets wins."""
    run = load_run(micro_run(precision="bf16-true"))
    assert run.train.update_chunk is None
    assert (update_chunk(run.train, "cpu"), update_chunk(run.train, "cuda")) == (1 << 20, 1 << 24)
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        assert trainer.optimizer.chunk == 1 << 20
    finally:
        trainer.close()
    assert update_chunk(load_run(micro_run(precision="bf16-true", update_chunk=0)).train,
                        "cuda") == 0


def test_chunks_are_bounded_and_cover_every_element_once():
    sizes = [3, 10, 1, 25]
    cut = chunks(sizes, 8)
    assert [sum(b - a for _, a, b in c) for c in cut] == [8, 8, 8, 8, 7]
    covered = sorted((i, k) for c in cut for i, a, b in c for k in range(a, b))
    assert covered == [(i, k) for i, n in enumerate(sizes) for k in range(n)]
    # whole tensors: never cut, a tensor larger than the chunk alone
    assert chunks(sizes, 8, whole=True) == [[(0, 0, 3)], [(1, 0, 10)], [(2, 0, 1)],
                                             [(3, 0, 25)]]
    assert chunks([3, 4, 1], 8, whole=True) == [[(0, 0, 3), (1, 0, 4), (2, 0, 1)]]


@pytest.mark.parametrize("mode", MODES)
def test_a_steps_temporaries_are_bounded_by_the_chunk(mode):
    """A 1000-element weight: with chunks of 100 no temporary exceeds 100 elements; one
    parameter at a time, the weight's float32 copies are 1000."""
    def largest(chunk: int) -> int:
        params = [torch.randn(1000).to(BF16), torch.randn(200).to(BF16)]
        opt = AdamW(params, lr=1e-2, update_chunk=chunk, compensation=mode)
        train(params, opt, steps=1)  # states exist: the next step makes temporaries only
        for p in params:
            p.grad = torch.randn(p.shape).to(BF16)
        with Ops() as ops:
            opt.step()
        return ops.largest

    assert largest(100) == 100
    assert largest(0) == 1000


def step_ops(step: Any) -> int:
    """Operators dispatched by the third call of `step` (the first two warm up)."""
    step()
    step()
    with Ops() as ops:
        step()
    return ops.total


def bare_step_ops(run: Any) -> int:
    """The loop a user would write: the bf16 model, torch's fused AdamW, clipping."""
    model = build_model(run.model, 128, run.task.seq_len, 0).to(BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 128, (run.train.batch_size, run.task.seq_len))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step_ops(step)


def harness_step_ops(tmp_path: Path, chunk: int) -> int:
    data = micro_run(precision="bf16-true", update_chunk=chunk, batch_size=2, total_batch_size=2,
                     log_every=100)
    data["model"], data["eval"] = "llama_tiny", {"every": 0, "tokens": 256}
    run = load_run(data)
    trainer = Trainer(run, Records(tmp_path / str(chunk), run), lambda step: False)
    try:
        return step_ops(trainer.train_step), run
    finally:
        trainer.close()


def test_a_bf16_true_step_dispatches_about_what_a_bare_loop_does(tmp_path):
    """llama_tiny at bf16-true: the harness's step, its own loss included, at a GPU's chunk
    (2^24 elements: where dispatches cost), within 10% of the operators of a bare loop's (the
    same model, batch and precision, the model's own loss, torch's fused AdamW); one parameter
    at a time its update alone adds about 12 operators a parameter, well beyond."""
    chunked, run = harness_step_ops(tmp_path, 1 << 24)
    paramwise, _ = harness_step_ops(tmp_path, 0)
    bare = bare_step_ops(run)
    assert chunked <= 1.1 * bare, (chunked, bare)
    assert paramwise > 1.1 * bare, (paramwise, bare)
