"""Q-GaLore quantization blocks, checked against their definitions and against q-galore-torch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.cost.tensor_peak import _peak, _timeline
from harness.methods.memory import tensor_bytes
from harness.methods.quant import (
    CHUNK,
    GROUP,
    INT8_MAX,
    Int8Linear,
    LazyGap,
    _codes,
    _groups,
    _trim,
    dequantize_int4_packed,
    dequantize_int8,
    int4_packed_bytes,
    int8_bytes,
    pack_int4,
    quantize_int4_packed,
    quantize_int8,
    requantize_int8,
    unpack_int4,
)

SHAPES = [(64, 512), (3, 100), (7,), (1, 1), (5, 257)]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stochastic_round_int8(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, generator: torch.Generator,
    group: int = GROUP,
) -> torch.Tensor:
    """Codes of `w` on a given grid, rounded up with probability frac(w / scale): the rounding
    quantize_int8 does with a generator, here on a grid held fixed across draws."""
    return _trim(_codes(_groups(w, group), scale.float(), zero, INT8_MAX, generator), w.shape)


def per_element(v: torch.Tensor, n: int, group: int = 256) -> torch.Tensor:
    return v.float().repeat_interleave(group)[:n]


def test_sr_is_unbiased_where_nearest_is_biased():
    scale, zero, draws = torch.tensor([0.01]), torch.tensor([128], dtype=torch.uint8), 2000
    frac = torch.rand(256, generator=gen(1)) * 0.8 + 0.1  # away from the grid points
    x = (torch.randint(-100, 100, (256,), generator=gen(2)) + frac) * scale
    codes = stochastic_round_int8(x.repeat(draws), scale.repeat(draws), zero.repeat(draws), gen())
    mean = dequantize_int8(codes, scale.repeat(draws), zero.repeat(draws)).view(draws, 256).mean(0)
    se = 0.5 * scale / math.sqrt(draws)  # the largest standard error of one Bernoulli mean
    assert (mean - x).abs().max() < 5 * se
    near = dequantize_int8(torch.round(x / scale + zero).to(torch.uint8), scale, zero)
    assert (near - x).abs().mean() > 0.15 * scale > 10 * se


def test_sr_accumulates_updates_smaller_than_the_step():
    lin = Int8Linear.from_linear(nn.Linear(256, 16))
    start, delta = lin.dequantized().mean(), 0.05 * lin.scale.mean()
    g = gen()
    for _ in range(100):
        lin.apply_update(torch.full((16, 256), delta.item()), g)
    drift = lin.dequantized().mean() - start
    assert abs(drift - 100 * delta) < 0.1 * 100 * delta
    # nearest rounding would lose every one of these updates
    codes, scale, zero = quantize_int8(nn.Linear(256, 16).weight)
    w = dequantize_int8(codes, scale, zero)
    assert torch.equal(quantize_int8(w + 0.05 * scale.min(), 256)[0], codes)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_nearest_round_trip_within_half_a_step(shape):
    w = torch.randn(shape, generator=gen()) * 0.02
    codes, scale, zero = quantize_int8(w)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(w.numel() / 256),)
    err = (dequantize_int8(codes, scale, zero) - w).abs().reshape(-1)
    assert (err <= per_element(scale, w.numel()) / 2 * (1 + 1e-5)).all()


def test_group_on_one_side_of_zero_keeps_its_range():
    w = torch.rand(512) + 1.0  # all in [1, 2]: the grid widens to contain 0
    codes, scale, zero = quantize_int8(w)
    assert (zero == 0).all() and codes.max() == 255
    assert (dequantize_int8(codes, scale, zero) - w).abs().max() <= scale.max() / 2 * (1 + 1e-5)


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1001])
def test_int4_packing_round_trips_codes(n):
    codes = torch.randint(0, 16, (n,), generator=gen(n), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 2),)
    assert torch.equal(unpack_int4(packed, n), codes)
    assert torch.equal(packed[0] & 0x0F, codes[0])  # low nibble first


@pytest.mark.parametrize("shape", [(512, 128), (33, 7), (301,)])
def test_int4_projection_within_half_a_step(shape):
    x = torch.linalg.qr(torch.randn(shape[0], shape[-1] if len(shape) > 1 else 1))[0]
    x = x.reshape(shape)
    packed, scale, zero = quantize_int4_packed(x)
    assert packed.numel() == math.ceil(x.numel() / 2)
    err = (dequantize_int4_packed(packed, scale, zero, x.shape) - x).abs().reshape(-1)
    assert (err <= per_element(scale, x.numel()) / 2 * (1 + 1e-5)).all()
    assert scale.max() < 2 * x.abs().max() / 15 + 1e-6  # a 4-bit step, not an 8-bit one


@pytest.mark.parametrize("shape", [*SHAPES, (512, 1376)])
@pytest.mark.parametrize("group", [256, 128, 100])
def test_byte_counts_are_exact(shape, group):
    w = torch.randn(shape)
    assert int8_bytes(shape, group) == tensor_bytes(quantize_int8(w, group))
    assert int8_bytes(shape, group) == tensor_bytes(quantize_int8(w, group, gen()))
    assert int4_packed_bytes(shape, group) == tensor_bytes(quantize_int4_packed(w, group))
    assert all(t.untyped_storage().nbytes() == tensor_bytes(t) for t in quantize_int8(w, group))
    if len(shape) == 2:
        lin = Int8Linear.from_linear(nn.Linear(shape[1], shape[0], bias=False), group)
        assert tensor_bytes(list(lin.buffers())) == int8_bytes(shape, group)
        assert list(lin.parameters()) == []


def unit_at(prev: torch.Tensor, cos: float, seed: int) -> torch.Tensor:
    """A unit vector whose cosine with the unit vector `prev` is `cos`."""
    r = torch.randn(prev.shape, generator=gen(seed))
    r = r - (r @ prev) * prev
    return cos * prev + math.sqrt(1 - cos * cos) * r / r.norm()


def test_lazy_gap_grows_exactly_when_the_queue_mean_reaches_the_threshold():
    lazy = LazyGap(10, queue_size=5, threshold=0.4, gamma=2)
    v = torch.nn.functional.normalize(torch.randn(8, generator=gen()), dim=0)
    lazy.observe(0, v)
    step = 0
    # (cosine, gap and queue length after it): never before 5 cosines, then the queue restarts;
    # in the second round the running means are 0.24, 0.39, 0.41
    schedule = [(0.9, 10, 1), (0.9, 10, 2), (0.9, 10, 3), (0.9, 10, 4), (0.9, 20, 0),
                (0.1, 20, 1), (0.1, 20, 2), (0.1, 20, 3), (0.69, 20, 4), (0.21, 20, 5),
                (0.85, 20, 5), (0.2, 40, 0)]
    for i, (cos, gap, queued) in enumerate(schedule, start=1):
        assert not lazy.due(step + lazy.gap - 1) and lazy.due(step + lazy.gap)
        step += lazy.gap
        v = unit_at(v, cos, i)
        assert lazy.observe(step, v) == pytest.approx(cos, abs=1e-6)
        assert lazy.gap == gap and len(lazy.queue) == queued
    assert lazy.svd_count == 13
    assert lazy.observe(step + 40, -v) == pytest.approx(1.0)  # a sign flip: same direction


def test_lazy_gap_resumes_exactly():
    vectors = torch.randn(12, 8, generator=gen()) * 0.3 + 1
    a = LazyGap(2, queue_size=3)
    steps = [s for s in range(60) if a.due(s) and (a.observe(s, vectors[a.svd_count]) or True)]
    b, c = LazyGap(2, queue_size=3), LazyGap(2, queue_size=3)
    for s in steps[:5]:
        b.observe(s, vectors[b.svd_count])
    c.load_state_dict(b.state_dict())
    rest = [s for s in range(steps[4] + 1, 60)
            if c.due(s) and (c.observe(s, vectors[c.svd_count]) or True)]
    assert steps[5:] == rest and a.state_dict()["gap"] == c.gap > 2


def test_lazy_gap_reference_schedule_matches_q_galore_torch():
    """schedule 'reference' keeps GaLoreProjector's rolling queue, gap and signed cosine, fed
    the same first singular vectors; ours reads a sign flip as the same direction."""
    from q_galore_torch.q_galore_projector import GaLoreProjector

    ref = GaLoreProjector(rank=1, update_proj_gap=3)
    ours = LazyGap(3, schedule="reference")
    v = torch.nn.functional.normalize(torch.randn(16, generator=gen()), dim=0)
    for i, cos in enumerate([1.0, 0.3, 0.1, 0.2, 0.3, 0.35, 0.2, 0.9, 0.95, 0.9, 0.99, 0.9]):
        v = unit_at(v, cos, i) if i else v
        ref.get_orthogonal_matrix = lambda *_, v=v, **__: v[:, None].clone()  # feed it this vector
        ref.project(torch.zeros(16, 32), 0)  # iteration 0: an SVD on every call
        ours.observe(i, v)
        assert ours.gap == ref.update_proj_gap and ours.svd_count == ref.svd_count
        assert ours.queue == pytest.approx(ref.queue, abs=1e-6)
    assert ours.gap == 3 * 2**4  # the rolling queue grows the gap at every aligned SVD
    assert [s for s in range(40, 120) if ours.due(s)] == [48, 96]  # step % gap, not gap after
    ref.get_orthogonal_matrix = lambda *_, **__: -v[:, None]  # the reference reads a flip as -1
    ref.project(torch.zeros(16, 32), 0)
    assert ref.queue[-1] == pytest.approx(-1.0) and ours.observe(12, -v) == pytest.approx(-1.0)
    absolute = LazyGap(3)
    absolute.observe(0, v)
    assert absolute.observe(3, -v) == pytest.approx(1.0)


def test_int8_codes_match_reference_nearest_and_stochastic():
    from q_galore_torch.q_galore_adamw8bit import AdamW8bit

    w = torch.randn(64, 512, generator=gen()) * 0.02
    codes, scale, zero = quantize_int8(w)
    rcodes, rscale, rzero = AdamW8bit._quantize(None, w, q_group_size=256)
    assert torch.equal(codes, rcodes) and torch.equal(scale, rscale.flatten())
    assert torch.equal(zero.float(), rzero.flatten())
    deq = AdamW8bit._dequantize(None, rcodes, torch.float32, 256, rscale, rzero)
    assert torch.equal(dequantize_int8(codes, scale, zero), deq)
    torch.manual_seed(7)  # the reference draws from the global generator
    rcodes = AdamW8bit._quantize_stochastic_round(None, w, q_group_size=256)[0]
    assert torch.equal(quantize_int8(w, 256, gen(7))[0], rcodes)
    # where a group lies on one side of 0 the reference saturates; we do not
    pos = torch.rand(256) + 1.0
    rcodes, rscale, rzero = AdamW8bit._quantize(None, pos, q_group_size=256)
    ref_err = (AdamW8bit._dequantize(None, rcodes, torch.float32, 256, rscale, rzero) - pos)
    assert ref_err.abs().max() > 0.5
    assert (dequantize_int8(*quantize_int8(pos)) - pos).abs().max() < 0.01


def test_int4_codes_match_reference():
    from q_galore_torch.q_galore_projector import GaLoreProjector

    x = torch.linalg.qr(torch.randn(512, 64, generator=gen()))[0]
    packed, scale, zero = quantize_int4_packed(x)
    rcodes, rscale, rzero, _ = GaLoreProjector._quantize(None, x, q_group_size=256, n_bit=4)
    assert rcodes.numel() == 2 * packed.numel()  # the reference keeps one code per byte
    assert torch.equal(unpack_int4(packed, x.numel()), rcodes.flatten())
    assert torch.equal(scale, rscale.flatten()) and torch.equal(zero.float(), rzero.flatten())


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_gradients_match_float_linear(bias):
    lin = Int8Linear.from_linear(nn.Linear(256, 48, bias=bias))
    ref = nn.Linear(256, 48, bias=bias)
    ref.weight.data.copy_(lin.dequantized())
    if bias:
        ref.bias.data.copy_(lin.bias.detach())
    x = torch.randn(2, 5, 256, generator=gen())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = lin(xa)
    torch.testing.assert_close(y, ref(xb), rtol=0, atol=0)
    (y.square().sum() * 2).backward()
    ref(xb).square().sum().mul(2).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(lin.weight_grad, ref.weight.grad)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_fused_update_inside_backward():
    lin = Int8Linear.from_linear(nn.Linear(256, 32, bias=False))
    before, seen = lin.dequantized(), []

    def hook(module: Int8Linear, g: torch.Tensor) -> None:
        seen.append(g.clone())
        module.apply_update(-0.5 * g, gen(len(seen)))

    lin.grad_hook = hook
    x = torch.randn(4, 256, generator=gen())  # no input grad and no bias: the hook still runs
    lin(x).sum().backward()
    assert len(seen) == 1 and lin.weight_grad is None
    torch.testing.assert_close(seen[0], x.sum(0).expand(32, -1))
    after = lin.dequantized()
    assert (after - (before - 0.5 * seen[0])).abs().max() <= lin.scale.max() * (1 + 1e-5)
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()  # the input gradient uses this forward's weight, not the update
    torch.testing.assert_close(xg.grad, torch.ones(4, 32) @ after)
    assert len(seen) == 2 and not torch.equal(lin.dequantized(), after)


def test_stochastic_update_is_reproducible_from_saved_generator_state():
    lin = Int8Linear.from_linear(nn.Linear(300, 20))
    g = gen(5)
    delta = torch.randn(20, 300, generator=gen()) * 1e-3
    lin.apply_update(delta, g)
    state, saved = g.get_state(), {k: v.clone() for k, v in lin.state_dict().items()}
    lin.apply_update(delta, g)
    again = Int8Linear(300, 20, bias=True)
    again.load_state_dict(saved)
    resumed = torch.Generator()
    resumed.set_state(state)
    again.apply_update(delta, resumed)
    for key, value in lin.state_dict().items():
        assert torch.equal(value, again.state_dict()[key])


def test_an_update_allocates_chunks_not_float32_copies_of_the_matrix():
    """Beside what it is given (delta, 4 n bytes; the codes, n) and what it makes (new codes,
    n), apply_update's transients stay below one float32 copy of the weight (4 n): the
    whole-matrix form held ~7 at once (over a GB above the estimate at LLaMA-7B). Counted
    from the tensors torch's profiler saw, the inputs included."""
    layer = Int8Linear.from_linear(nn.Linear(4096, 4096, bias=False))  # n = 16 Mi values
    delta = torch.randn(4096, 4096) * 1e-3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, record_shapes=True, with_stack=True) as prof:
        layer.apply_update(delta, gen())
    peak, _ = _peak(_timeline(prof))
    n = 4096 * 4096
    assert 6 * n <= peak < 10 * n  # chunked: 7.6 n (4 MiB float32 chunks); whole: 30 n


def test_a_chunked_update_draws_the_codes_of_the_whole_matrix_form():
    """Chunks start on group boundaries and draw the CPU generator in order: the codes equal
    quantize_int8(dequantize_int8(...) + delta) on the whole matrix, the last group short."""
    w = torch.randn(2 * CHUNK * GROUP + 1000 + 7)
    codes, scale, zero = quantize_int8(w)
    delta = torch.randn_like(w) * 1e-3
    whole = quantize_int8(dequantize_int8(codes, scale, zero) + delta, GROUP, gen(5))
    chunked = requantize_int8(codes, scale, zero, delta, GROUP, gen(5))
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
