"""Host offload of activations (saved-tensor hooks) and of optimizer states.

Activations follow the fine-grained offloading design of Megatron-Core: only the tensors that
chosen modules save for backward move, and only those of at least `min_bytes` that are not
parameters or buffers (weights stay where they live). On CUDA a tensor is copied into pinned
host memory on a side stream as soon as forward saves it; `record_stream` lets the allocator
reuse its device memory once that copy is done. In backward, the first tensor a layer needs
brings that layer back (if the prefetch has not already), and starts copying the next layer
backward will reach, on the side stream, while the current one computes: at most one layer
beyond the one computing is resident. On CPU the same code path runs and the "host copy" is a
plain copy, so CI tests it; the savings exist only on an accelerator.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


class _Saved:
    """One offloaded tensor: its host copy, then its device copy once fetched back."""

    __slots__ = ("__weakref__", "device", "host", "layer", "ready")

    def __init__(self, layer: int, host: Tensor) -> None:
        self.layer, self.host = layer, host
        self.device: Tensor | None = None
        self.ready: torch.cuda.Event | None = None


def storages(module: nn.Module) -> set[int]:
    """Where the module's parameters and buffers live now."""
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


class ActivationOffloader:
    """Moves saved activations to the host; `hooks(layer, module)` keeps the module's own
    parameters and buffers, as they are at each forward, where they are."""

    def __init__(self, device: torch.device, min_bytes: int) -> None:
        self.device, self.min_bytes = device, min_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, list[weakref.ref[_Saved]]] = {}  # by layer, not yet fetched
        self.current: int | None = None  # the layer backward is in
        self.bytes = 0  # moved to the host since the last `take_bytes`

    @contextmanager
    def hooks(self, layer: int, module: nn.Module | None = None) -> Iterator[None]:
        """Saved tensors of what runs inside go through `pack`, except `module`'s parameters
        and buffers, read at this forward, not once: a method may rebind them between steps
        (Q-GaLore's and APOLLO's INT8 codes, scales and zero points are new tensors after each
        update), and pointers taken once would then move those weights to the host and back
        every step, and keep whatever tensor the allocator later puts at an old address."""
        keep = storages(module) if module is not None else set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(layer, t, keep),
                                                      self.unpack):
            yield

    def pack(self, layer: int, t: Tensor, keep: Collection[int] = ()) -> Any:
        nbytes = t.numel() * t.element_size()
        # off the device (CUDA attention's host-side seed and offset): no device memory, and
        # backward needs it where it is
        if (nbytes < self.min_bytes or t.device.type != self.device.type
                or t.untyped_storage().data_ptr() in keep):
            return t
        self.current = None  # a forward is running: the next backward starts afresh
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=self.cuda)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
        else:
            host.copy_(t)
        saved = _Saved(layer, host)
        self.pending.setdefault(layer, []).append(weakref.ref(saved))
        self.bytes += nbytes
        return saved

    def unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if saved.layer != self.current:  # backward reached a new layer
            self.current = saved.layer
            self._fetch(saved.layer)
            below = [k for k in self.pending if k < saved.layer]
            if below:
                self._fetch(max(below))  # overlaps the next layer's copy with this one's compute
        if saved.device is None:  # a tensor saved after its layer was fetched
            self._fetch_one(saved)
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(saved.ready)
            saved.device.record_stream(main)  # type: ignore[union-attr]
        tensor, saved.device, saved.host = saved.device, None, None
        return tensor  # type: ignore[return-value]

    def _fetch(self, layer: int) -> None:
        for ref in self.pending.pop(layer, []):
            saved = ref()
            if saved is not None and saved.device is None:
                self._fetch_one(saved)

    def _fetch_one(self, saved: _Saved) -> None:
        if self.stream is None:
            saved.device = saved.host
            return
        with torch.cuda.stream(self.stream):
            saved.device = saved.host.to(self.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self.stream)

    def take_bytes(self) -> int:
        taken, self.bytes = self.bytes, 0
        return taken


class HostOffloadOptimizer(torch.optim.Optimizer):
    """The method's optimizer over host copies of its parameters: a step copies the gradients to
    the host, updates there and copies the weights back, so no optimizer state ever occupies
    the device. The groups the scheduler and the loss scaler see hold the device parameters;
    their hyperparameters are passed to the host optimizer at each step. Its state dict is the
    host optimizer's, the same layout as without offload."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ) -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.pin = any(p.is_cuda for p in self.params)
        self.host = {p: self._host_tensor(p).copy_(p.detach()) for p in self.params}
        self.inner = build([{**g, "params": [self.host[p] for p in g["params"]]} for g in groups])
        self.defaults = self.inner.defaults
        self.param_groups = [  # type: ignore[assignment]
            {**ig, "params": list(g["params"])}
            for g, ig in zip(groups, self.inner.param_groups, strict=True)
        ]

    def _host_tensor(self, p: Tensor) -> Tensor:
        return torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin)

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return self.inner.state

    def _pass_settings(self) -> None:
        """The scheduler's LR (and any other setting) reach the host optimizer's groups."""
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        self._pass_settings()
        for p in self.params:
            host = self.host[p]
            if p.grad is None:
                host.grad = None
                continue
            if host.grad is None:
                host.grad = self._host_tensor(p)
            host.grad.copy_(p.grad, non_blocking=self.pin)
        if self.pin:
            torch.cuda.current_stream().synchronize()  # the host reads the gradients next
        self.inner.step()
        self.take_settings()  # what the step counts in its groups (Schedule-Free's k) kept
        for p in self.params:
            if p.grad is not None:
                p.copy_(self.host[p], non_blocking=self.pin)

    def take_settings(self) -> None:
        """The host optimizer's group settings (counters a step or a mode switch changed) into
        the groups the scheduler sees, which `_pass_settings` hands back at the next step."""
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            group.update({k: v for k, v in inner.items() if k != "params"})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        self._pass_settings()
        return self.inner.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The model was loaded first: the host copies take its weights again."""
        self.inner.load_state_dict(state_dict)
        for p in self.params:
            self.host[p].copy_(p)
        self.take_settings()


def repaged_on_load(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """bitsandbytes' paged optimizer, whose moments loaded from a checkpoint are paged again.
    bitsandbytes pages them as it creates them (`get_state_buffer`: CUDA unified memory from
    1e5 entries), but its `load_state_dict` moves the saved ones to the parameter's device, so
    that a resumed run would hold every moment in device memory. Here they load on the host
    and go into new buffers (paged where bitsandbytes pages); `step` moves the rest (quantization
    maps and scales) to the device as it starts."""
    load = optimizer.load_state_dict

    def load_paged(state_dict: dict[str, Any]) -> None:
        load(state_dict, move_to_device=False)  # type: ignore[call-arg]
        for param, state in optimizer.state.items():
            for key in ("state1", "state2"):
                if key in state:
                    buffer = optimizer.get_state_buffer(param, state[key].dtype)  # type: ignore[attr-defined]
                    state[key] = buffer.copy_(state[key])

    optimizer.load_state_dict = load_paged  # type: ignore[method-assign]
    return optimizer
