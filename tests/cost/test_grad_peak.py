"""GradPeak (harness/cost/grad_peak.py): the most gradient bytes alive at once in a step,
counted from the tensors. Each expected value is arithmetic on the model's shapes written out
here, never the estimator's formula; and a leaking optimizer must show as a larger peak."""

from __future__ import annotations

import torch
from conftest import micro_model, micro_run

from harness.cost.grad_peak import GradPeak
from harness.methods import build_method, optimizer_for
from harness.methods.quant import Int8Linear
from harness.methods.resolve import load_run
from harness.modifiers.layerwise import LayerwiseOptimizer

# llama_micro on a 32-token vocabulary: the MLP's 176 x 64 matrices (11,264 weights) are its
# largest tensors; embedding and head are 32 x 64 (2,048). See test_shapes_this_file_assumes.
VOCAB, MLP, TABLE = 32, 176 * 64, 32 * 64


def model() -> torch.nn.Module:
    return micro_model(0, vocab=VOCAB)


def backward(net: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    net(input_ids=ids, labels=ids).loss.backward()


def watched(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    watch = GradPeak(net, optimizer)
    backward(net)
    optimizer.step()
    return watch.close()


def prepared(net: torch.nn.Module, method: dict, layerwise: bool) -> tuple:
    run = load_run({**micro_run(), "method": method, "memory": {"layerwise": layerwise}})
    m = build_method(run)
    net = m.prepare(net, run)
    return net, optimizer_for(m, net, run)


def test_shapes_this_file_assumes():
    sizes = sorted(p.numel() for p in model().parameters())
    assert sizes[-1] == MLP and sizes.count(MLP) == 6  # gate, up, down in each of 2 blocks
    assert max(s for s in sizes if s != MLP) == 64 * 64


def test_a_plain_step_peaks_with_every_gradient_alive():
    net, opt = prepared(model(), {"name": "full"}, layerwise=False)
    n = sum(p.numel() for p in net.parameters())
    assert watched(net, opt) == 4 * n  # every fp32 gradient, all alive once backward ends


def test_layerwise_holds_the_largest_gradient_only():
    net, opt = prepared(model(), {"name": "full"}, layerwise=True)
    assert watched(net, opt) == 4 * MLP
    assert all(p.grad is None for p in net.parameters())


class KeepsGradients(LayerwiseOptimizer):
    """A layer-wise optimizer with the bug the watch exists to catch: it never frees `.grad`."""

    def _update(self, param: torch.Tensor) -> None:
        self.inner[param].step()


def test_a_layerwise_optimizer_that_keeps_gradients_peaks_with_all_of_them():
    net = model()
    params = list(net.parameters())
    opt = KeepsGradients(params, lambda p: torch.optim.SGD([p], lr=0.1), clip=None)
    assert watched(net, opt) == 4 * sum(p.numel() for p in params)


def int8(net: torch.nn.Module) -> list[Int8Linear]:
    return [m for m in net.modules() if isinstance(m, Int8Linear)]


def test_int8_weights_count_their_g_one_layer_at_a_time():
    """Q-GaLore: 14 INT8 linears take G (float32, out x in) in backward and drop it after their
    update; the float parameters step layer-wise. The largest alive at once is one MLP G."""
    net, opt = prepared(model(), {"name": "qgalore", "rank": 8}, layerwise=False)
    assert len(int8(net)) == 14
    assert watched(net, opt) == 4 * MLP


def test_int8_gradients_nobody_takes_are_summed_in_the_layer_and_counted():
    """Without Q-GaLore's optimizer (its hooks) each layer keeps G in `weight_grad`: all 14 stay
    alive, next to the float gradients (2 tables and 5 norm vectors) a plain SGD keeps."""
    run = load_run({**micro_run(), "method": {"name": "qgalore", "rank": 8}})
    net = build_method(run).prepare(model(), run)
    plain = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    layers = 2 * (4 * 64 * 64 + 3 * MLP)
    floats = 2 * TABLE + 5 * 64
    assert watched(net, plain) == 4 * (layers + floats)
    assert all(m.weight_grad is not None for m in int8(net))


def test_close_restores_the_layers_and_stops_counting():
    net, opt = prepared(model(), {"name": "qgalore", "rank": 8}, layerwise=False)
    watch = GradPeak(net, opt)
    watch.close()
    assert all("_receive" not in vars(m) for m in int8(net))
    backward(net)
    assert watch.peak == 0
