"""harness/modifiers/offload.py on CPU (the same code path as CUDA, with plain copies): which
saved tensors move, that backward gets them back equal, and host optimizer states that train
like the plain optimizer."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from harness.modifiers.offload import ActivationOffloader, HostOffloadOptimizer

CPU = torch.device("cpu")


def saved_kinds(offloader: ActivationOffloader, layer: int, x: torch.Tensor, w: torch.Tensor):
    """Run y = (x @ w).relu() under the offloader's hooks; return what each saved becomes."""
    packed = []
    pack = offloader.pack

    def spy(layer_: int, t: torch.Tensor, *keep):
        result = pack(layer_, t, *keep)
        packed.append(type(result).__name__)
        return result

    offloader.pack = spy
    holder = nn.Module()  # w as a module's parameter: the hooks keep those where they are
    holder.w = w
    with offloader.hooks(layer, holder):
        y = (x @ w).relu()
    return y, packed


def test_small_tensors_and_parameters_stay_large_activations_move():
    w = nn.Parameter(torch.randn(64, 64))
    offloader = ActivationOffloader(CPU, min_bytes=1024)
    x = torch.randn(32, 64, requires_grad=True)
    y, packed = saved_kinds(offloader, 0, x, w)
    # mm saves x (8 kB: moved) and w (kept: a parameter); relu saves its output (8 kB: moved)
    assert sorted(packed) == ["Parameter", "_Saved", "_Saved"]
    assert offloader.take_bytes() == 2 * 32 * 64 * 4 and offloader.take_bytes() == 0
    assert list(offloader.pending) == [0] and len(offloader.pending[0]) == 2
    assert all(ref() is not None for ref in offloader.pending[0])  # y's graph holds them
    y.sum().backward()
    assert not offloader.pending
    small = ActivationOffloader(CPU, min_bytes=1 << 20)
    _, kept = saved_kinds(small, 0, x, w)
    assert "_Saved" not in kept and small.take_bytes() == 0


def test_a_tensor_off_the_training_device_stays_where_it_is():
    """CUDA's memory-efficient attention saves 0-dim seed and offset tensors on the host: no
    device memory to free, and backward needs them there (the "device" is meta here)."""
    offloader = ActivationOffloader(torch.device("meta"), min_bytes=0)
    host = torch.ones(2)
    assert offloader.pack(0, host) is host and offloader.take_bytes() == 0


def three_layers(x: torch.Tensor, w: torch.Tensor, offloader=None) -> torch.Tensor:
    for layer in range(3):
        with offloader.hooks(layer) if offloader else nullcontext():
            x = (x @ w).relu()
    return x.pow(2).sum()


def test_backward_through_offloaded_tensors_gives_the_same_gradients():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 16) / 4)
    x = torch.randn(8, 16, requires_grad=True)
    three_layers(x, w).backward()
    plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    offloader = ActivationOffloader(CPU, min_bytes=0)
    loss = three_layers(x, w, offloader)
    assert sorted(offloader.pending) == [0, 1, 2]
    assert offloader.take_bytes() == 3 * 2 * 8 * 16 * 4 + 16 * 16 * 4 * 3  # inputs, outputs, w
    loss.backward()
    assert torch.equal(x.grad, plain[0]) and torch.equal(w.grad, plain[1])
    assert not offloader.pending and offloader.current == 0  # fetched back down to layer 0


def test_unpack_passes_through_what_was_not_moved():
    offloader = ActivationOffloader(CPU, min_bytes=0)
    t = torch.ones(3)
    assert offloader.unpack(t) is t


def make_params(seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))]


def adamw(groups):
    return torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01)


def run_steps(params, optimizer, steps: int, lr_at: dict[int, float] | None = None) -> None:
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = (lr_at or {}).get(step, group["lr"])
        loss = sum((p * (k + 1)).sin().sum() for k, p in enumerate(params))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_host_offload_trains_exactly_like_the_plain_optimizer():
    ref, ours = make_params(), make_params()
    plain = adamw([{"params": ref}])
    host = HostOffloadOptimizer([{"params": ours}], adamw)
    assert host.param_groups[0]["params"] == ours  # the scheduler sees the device params
    assert all(host.host[p] is not p for p in ours)
    run_steps(ref, plain, 4, lr_at={2: 0.01})  # a scheduler's change reaches the host copy
    run_steps(ours, host, 4, lr_at={2: 0.01})
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    assert host.inner.param_groups[0]["lr"] == 0.01
    states = list(host.state.values())
    assert len(states) == 2 and all(s["exp_avg"].device == CPU for s in states)
    assert all(p.grad is None for p in ours)


def test_host_offload_state_dict_resumes_exactly():
    ref = make_params()
    straight = HostOffloadOptimizer([{"params": ref}], adamw)
    run_steps(ref, straight, 5)

    first = make_params()
    opt = HostOffloadOptimizer([{"params": first}], adamw)
    run_steps(first, opt, 2)
    saved, weights = opt.state_dict(), [p.detach().clone() for p in first]

    resumed = make_params(seed=1)  # a new process: other weights until the checkpoint loads
    with torch.no_grad():
        for p, w in zip(resumed, weights, strict=True):
            p.copy_(w)
    again = HostOffloadOptimizer([{"params": resumed}], adamw)
    again.load_state_dict(saved)
    run_steps(resumed, again, 3)
    assert all(torch.equal(a, b) for a, b in zip(ref, resumed, strict=True))


def test_paged_states_loaded_from_a_checkpoint_go_into_new_state_buffers(tmp_path):
    """A resumed paged optimizer's moments are the buffers bitsandbytes makes for them (paged on
    CUDA), not the loaded tensors moved to the device: each holds the saved values, and
    training goes on as it would have without the stop."""
    import bitsandbytes as bnb

    from harness.modifiers.offload import repaged_on_load

    made = []

    def paged(params):
        opt = repaged_on_load(bnb.optim.PagedAdamW8bit(params, lr=0.1, min_8bit_size=16))
        buffer = opt.get_state_buffer
        opt.get_state_buffer = lambda p, dtype: made.append(buffer(p, dtype)) or made[-1]
        return opt

    ref = make_params()
    run_steps(ref, paged(ref), 4)
    params = make_params()
    opt = paged(params)
    run_steps(params, opt, 2)
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    saved = {(p, k): opt.state[p][k].clone() for p in params for k in ("state1", "state2")}
    made.clear()
    again = paged(params)
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    loaded = [again.state[p][k] for p, k in saved]
    assert len(made) == len(loaded) == 4 and all(a is b for a, b in zip(made, loaded, strict=True))
    assert all(torch.equal(t, saved[pk]) for t, pk in zip(loaded, saved, strict=True))
    run_steps(params, again, 2)
    assert all(torch.equal(a, b) for a, b in zip(ref, params, strict=True))
