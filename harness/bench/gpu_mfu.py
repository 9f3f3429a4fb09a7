"""The CUDA kit's `mfu` part: how fast full AdamW trains LLaMA-1B at 64 × 256 tokens under
bf16-true, and what each speed lever of docs/training.md buys there.

In the order that lets a part cut off at its cap keep what matters most: each of the model's
matmuls alone (the GEMM probe: what its shapes can reach on this device); the baseline with
every lever off; each lever alone; the levers that helped, together, at the paper's MLP width
(target 40% MFU) and with the MLP padded to a multiple of 64 (45%); GaLore, 8-bit Adam and
APOLLO with those levers; 32-true with and without TF32 last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

from harness.bench.gpu_settings import Record, Settings, kit_run, measured
from harness.bench.memory import free_memory
from harness.cost.estimate import vocab_size
from harness.cost.meter import peak_flops
from harness.errors import UserError
from harness.models import param_shapes

Keys = dict[str, dict[str, Any]]  # a run's "train" and "model_options" keys
BASELINE: Keys = {"train": {"update_chunk": 0}}  # every lever off: one parameter at a time
PADDED = "mlp_64"  # changes the model's shape: apart from the best at the paper's width
TARGETS = {"best": 0.40, "best_padded": 0.45}  # MFU, issue 67
METHODS = ("galore", "adam8bit", "apollo")


def levers(tokens: int) -> dict[str, Keys]:
    """Each lever's keys; the chunked loss takes a quarter of the step's tokens at once."""
    return {
        "multi_tensor": {"train": {"update_chunk": 1 << 24}},
        "compile": {"train": {"compile": True}},
        "loss_chunk": {"train": {"loss_chunk": tokens // 4}},
        "liger": {"model_options": {"kernels": "liger"}},
        PADDED: {"model_options": {"mlp_multiple_of": 64}},
    }


def combined(*parts: Keys) -> Keys:
    """Keys of several levers together, later ones winning (a lever over the baseline)."""
    out: Keys = {"train": {}, "model_options": {}}
    for part in parts:
        for section, keys in part.items():
            out[section] |= keys
    return out


def mfu(s: Settings, out: Path) -> Iterator[Record]:
    tokens = s.mfu_batch * (256 if s.device == "cuda" else s.seq_len)
    model = s.table11
    yield from gemms(s, tokens, vocab_size("sample"))
    each = levers(tokens)
    base = _record(s, "full/baseline", [], combined(BASELINE), {"name": "full"})
    yield base
    alone = {name: _record(s, f"full/{name}", [name], combined(BASELINE, keys),
                           {"name": "full"}, base) for name, keys in each.items()}
    yield from alone.values()
    helped = [n for n, r in alone.items() if r["status"] == "ok" and n != PADDED
              and (base["status"] != "ok" or r["tokens_per_s"] > base["tokens_per_s"])]
    best_keys = combined(BASELINE, *(each[n] for n in helped))
    best = _judged(_record(s, "full/best", helped, best_keys, {"name": "full"}, base), "best")
    yield best
    yield _judged(_record(s, "full/best_padded", [*helped, PADDED],
                          combined(best_keys, each[PADDED]), {"name": "full"}, base),
                  "best_padded")
    for name in METHODS:
        method = {"name": name, **({} if name == "adam8bit" else {"rank": s.rank_1b})}
        if name == "galore":  # randomized SVDs, as in table11: the first step's exact ones
            method["svd"] = "randomized"  # could take much of the cap (step 1 is not timed)
        record = _record(s, f"{name}/best", helped, best_keys, method)
        if record["status"] == "ok" and best["status"] == "ok":
            record["ratio_to_full"] = record["tokens_per_s"] / best["tokens_per_s"]
        yield record
    for label, tf32 in (("32-true", False), ("32-true_tf32", True)):
        run = kit_run(s, model, {"name": "full"}, batch_size=s.tf32_batch, steps=s.mfu_steps,
                      precision="32-true", **({"tf32": True} if tf32 else {}))
        yield _timed(f"gpu/mfu/{model}/full/{label}", s.tf32_batch, run, ["tf32"] * tf32)


def _record(s: Settings, label: str, names: list[str], keys: Keys, method: dict[str, Any],
            base: Record | None = None) -> Record:
    """One bf16-true run at the part's micro-batch with `keys`; its speed-up over `base`."""
    try:
        run = kit_run(s, s.table11, method, batch_size=s.mfu_batch, steps=s.mfu_steps,
                      precision="bf16-true", model_options=keys["model_options"] or None,
                      **keys["train"])
    except UserError as e:  # a lever this device cannot run, refused at load
        return {"name": f"gpu/mfu/{s.table11}/{label}", "levers": names,
                "batch": s.mfu_batch, "status": "refused", "error": str(e).splitlines()[0]}
    record = _timed(f"gpu/mfu/{s.table11}/{label}", s.mfu_batch, run, names)
    if base and base["status"] == "ok" and record["status"] == "ok":
        record["speedup"] = record["tokens_per_s"] / base["tokens_per_s"]
    return record


def _timed(name: str, batch: int, run: Any, names: list[str]) -> Record:
    record = {"name": name, "levers": names, "batch": batch, **measured(run)}
    if record["status"] == "ok" and record["tokens_per_s"]:
        record["ms_per_step"] = 1e3 * batch * run.task.seq_len / record["tokens_per_s"]
    return record


def _judged(record: Record, label: str) -> Record:
    """The record with its MFU target and `met`, where the device has a peak (a CPU has none:
    no MFU, no verdict)."""
    value, target = record.get("mfu"), TARGETS[label]
    return {**record, "target": target, "met": None if value is None else value >= target}


def _up(n: int) -> int:
    return -(-n // 64) * 64


def gemm_shapes(model: str, vocab: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """(out, in, the shape it was rounded up from or None) of each distinct matmul of the
    model (every 2-D weight but the input embedding, a lookup), and each with a dimension that
    is no multiple of 64 again with it rounded up: LLaMA-1B's MLP is 5461 wide, which leaves
    the bf16 tensor cores' tiles ragged."""
    shapes = sorted({(size[0], size[1]) for name, size in param_shapes(model, vocab).items()
                     if len(size) == 2 and "embed_tokens" not in name})
    padded = [(_up(o), _up(i), (o, i)) for o, i in shapes if (_up(o), _up(i)) != (o, i)]
    return [(o, i, None) for o, i in shapes] + padded


def gemms(s: Settings, tokens: int, vocab: int) -> Iterator[Record]:
    """Each matmul a linear layer's step makes (forward, input gradient, weight gradient:
    2 · tokens · in · out FLOPs each) alone on random bf16 data: the TFLOP/s the model's
    shapes can reach on this device, beside its peak."""
    free_memory()  # what an earlier part's run left
    device = torch.device(s.device)
    peak = peak_flops(device, "bf16-true")
    for out_f, in_f, padded_from in gemm_shapes(s.table11, vocab):
        # random data, never zeros: those can run faster than real values
        w, x, g = (torch.randn(*shape, device=device, dtype=torch.bfloat16)
                   for shape in ((out_f, in_f), (tokens, in_f), (tokens, out_f)))
        tflops = {name: 2 * tokens * in_f * out_f / _seconds(f, *args, s.gemm_s) / 1e12
                  for name, f, args in (("forward", torch.nn.functional.linear, (x, w)),
                                        ("input_grad", torch.matmul, (g, w)),
                                        ("weight_grad", torch.matmul, (g.t(), x)))}
        yield {"name": f"gpu/mfu/{s.table11}/gemm/{out_f}x{in_f}", "tokens": tokens,
               "out": out_f, "in": in_f, "padded_from": padded_from, "tflops": tflops,
               "peak_tflops": None if peak is None else peak / 1e12}


def _seconds(f: Callable[..., Any], a: torch.Tensor, b: torch.Tensor, least_s: float) -> float:
    """The median time of f(a, b), from torch's benchmark Timer (it warms up and synchronizes
    the device around each block of runs)."""
    timer = Timer("f(a, b)", globals={"f": f, "a": a, "b": b})
    return timer.blocked_autorange(min_run_time=least_s).median
