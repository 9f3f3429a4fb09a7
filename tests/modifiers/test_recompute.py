"""harness/modifiers/recompute.py: the decoder layers and module kinds it finds, and that a
recomputed module keeps fewer tensors for backward yet gives the same gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model
from torch import nn

from harness.config import MemoryConfig
from harness.errors import UserError
from harness.modifiers.offload import ActivationOffloader
from harness.modifiers.recompute import apply, decoder_layers, modules_of, recompute

CPU = torch.device("cpu")


def test_finds_the_layers_and_their_modules_by_kind(tiny_model):
    layers = decoder_layers(tiny_model)
    assert layers is tiny_model.model.layers and len(layers) == 2
    layer = layers[0]
    assert modules_of(layer, "attention") == [layer.self_attn]
    assert modules_of(layer, "mlp") == [layer.mlp]
    assert modules_of(layer, "norm") == [layer.input_layernorm, layer.post_attention_layernorm]


def test_a_model_without_layers_or_a_kind_is_a_user_error():
    with pytest.raises(UserError, match="memory: recompute and offload need a model with a "
                                        "ModuleList of layers"):
        decoder_layers(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(UserError, match=r"memory: the model's layers have no mlp module "
                                        r"\(mlp or intermediate or output\)"):
        modules_of(nn.Linear(2, 2), "mlp")


def saved_count(module: nn.Module, x: torch.Tensor) -> int:
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return count


def test_recompute_saves_only_the_inputs_and_gives_the_same_gradients():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(),
                        nn.Linear(32, 8))
    x = torch.randn(4, 8)
    plain_saved = saved_count(mlp, x)
    plain = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    recompute(mlp)
    assert saved_count(mlp, x) < plain_saved
    assert all(torch.equal(p.grad, g) for p, g in zip(mlp.parameters(), plain, strict=True))
    with torch.no_grad():  # eval: the wrapper calls the forward as it is
        assert mlp(x).shape == (4, 8)


def test_apply_wraps_what_the_config_names(tiny_model):
    assert apply(tiny_model, MemoryConfig(), CPU) is None
    assert apply(tiny_model, MemoryConfig(recompute=["attention"]), CPU) is None
    wrapped = {name for name, m in tiny_model.named_modules() if "forward" in vars(m)}
    assert wrapped == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    model = micro_model()
    offloader = apply(model, MemoryConfig(offload=["mlp"], offload_min_bytes=0), CPU)
    assert isinstance(offloader, ActivationOffloader) and offloader.min_bytes == 0
    moved = {name for name, m in model.named_modules() if "forward" in vars(m)}  # wrapped
    assert moved == {"model.layers.0.mlp"}  # the last layer's tensors are needed first: kept
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    packed = []  # (a weight's storage?, moved?) of each tensor the mlp saves
    pack = offloader.pack

    def spy(layer: int, t: torch.Tensor, *keep: set[int]) -> object:
        saved = pack(layer, t, *keep)
        packed.append((t.untyped_storage().data_ptr() in weights, saved is not t))
        return saved

    offloader.pack = spy
    model(input_ids=torch.randint(0, SAMPLE_VOCAB, (2, 16))).logits.sum().backward()
    assert (True, False) in packed and (False, True) in packed  # weights stay, the rest moves
    assert (True, True) not in packed and (False, False) not in packed


def test_weights_rebound_between_steps_still_stay():
    """Q-GaLore's and APOLLO's INT8 updates give a layer new codes, scales and zero points each
    step: they are read as weights at every forward, not from pointers taken once (which would
    move them to the host and back every step, and keep what later lands at an old address)."""
    from harness.methods.quant import Int8Linear

    model = micro_model()
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Int8Linear.from_linear(mlp.up_proj)
    offloader = apply(model, MemoryConfig(offload=["mlp"], offload_min_bytes=0), CPU)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    moved = []
    for _ in range(2):
        model(input_ids=ids).logits.sum().backward()
        moved.append(offloader.take_bytes())
        mlp.up_proj.apply_update(torch.zeros(176, 64), torch.Generator().manual_seed(0))
    assert moved[0] == moved[1] > 0


def test_full_recompute_of_the_model_changes_no_number():
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for memory in (MemoryConfig(), MemoryConfig(recompute="full")):
        model = micro_model(seed=0)
        apply(model, memory, CPU)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
