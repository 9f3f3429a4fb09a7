"""`harness plan`: every method x memory modifier x precision x micro-batch that fits a memory
budget, by `harness estimate`'s peak, ranked by a relative compute cost.

Candidates are loaded through `load_run`, so a combination a method (or the config) refuses is
skipped with its reason. Peaks are `estimate_run`'s, with one difference: under
`optimizer_offload: host` the optimizer states live in host memory, so the device's peak is
the estimate's minus them (the estimate counts every byte the process holds).

The cost model (docs/estimate.md, `harness plan`), in seconds a step on an assumed GPU
(`DEVICE`), divided by the same for full-rank AdamW, bf16-mixed, no modifier, one micro-batch:
- compute: per token, forward FLOPs (2 per weight a linear multiplies, 2·seq·d for causal
  attention, d the queries' width) and backward twice that for trained weights, once for
  frozen ones (LoRA's and QLoRA's base, QLoRA's head); factored linears multiply two rank-r
  factors. Recompute adds the recomputed modules' forward again. fp32 matmuls run at
  `fp32_flops` (the harness does not turn TF32 on), bf16 ones at `bf16_flops`;
- transfers over the host link: activation offload sends the offloaded activations to the host
  and back; optimizer offload sends the gradients down and the weights back up, every step;
- accumulation: each micro-batch adds a fixed launch overhead (`launch_s` per layer).
GaLore's SVDs, quantization kernels and 8-bit optimizers' own speed are not modelled.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from harness.config.objectives import size
from harness.config.steps import Steps
from harness.cost.activations import KIND_LINEARS, activations, targets, trains_norms
from harness.cost.estimate import estimate_run, memoized, run_shapes
from harness.errors import UserError
from harness.methods import method_names
from harness.methods.base import build_memory, get_method
from harness.methods.memory import Memory, numel
from harness.methods.resolve import load_run
from harness.methods.surgery import is_target
from harness.methods.widths import widths
from harness.models import architecture, head_shape


@dataclass(frozen=True)
class Device:
    """What the cost model assumes of the GPU: an H100 at realistic utilisation."""

    bf16_flops: float = 400e12  # ~40% of H100 SXM's 989 TFLOP/s dense bf16
    fp32_flops: float = 50e12  # ~75% of its 67 TFLOP/s fp32 (no TF32)
    host_bytes_s: float = 25e9  # PCIe 4.0 x16, effective
    launch_s: float = 100e-6  # a layer's kernels, forward and backward, per micro-batch


DEVICE = Device()

# The papers' rank for each preset (sweeps/c4_*.yaml: GaLore Tables 2 and 3); others get the
# method's default rank, at most a quarter of the hidden size.
PAPER_RANKS = {"llama_60m": 128, "llama_130m": 256, "llama_350m": 256, "llama_1b": 512,
               "llama_7b": 1024}  # fmt: skip
# Method entries beyond each registered method at its defaults: label -> (method, settings).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "galore_8bit": ("galore", {"optimizer": "adam8bit"}),
    "apollo_mini_int8": ("apollo_mini", {"int8_weights": True}),  # APOLLO's 7B recipe
}
# Precision label -> train keys; bf16 states are the GaLore and Q-GaLore reference code's choice.
PRECISIONS: dict[str, dict[str, str]] = {
    "bf16-true": {"precision": "bf16-true"},
    "bf16-true, bf16 states": {"precision": "bf16-true", "state_dtype": "bfloat16"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "32-true": {"precision": "32-true"},
}
ACTIVATION_MODIFIERS: dict[str, dict[str, Any]] = {
    "": {},
    "recompute full": {"recompute": "full"},
    "recompute attention": {"recompute": ["attention"]},
    "recompute mlp": {"recompute": ["mlp"]},
    "offload attention+mlp": {"offload": ["attention", "mlp"]},
    "recompute attention, offload mlp": {"recompute": ["attention"], "offload": ["mlp"]},
}
OPTIMIZER_MODIFIERS: dict[str, dict[str, Any]] = {
    "": {},
    "layerwise": {"layerwise": True},
    "optimizer host": {"optimizer_offload": "host"},
    "layerwise, optimizer host": {"layerwise": True, "optimizer_offload": "host"},
}
BREAKDOWN = ("weight_bytes", "grad_bytes", "optimizer_state_bytes", "extra_bytes", "peak_bytes")
TABLE11_CSV = "paper/galore_table11.csv"  # GaLore Table 11: LLaMA-1B tok/s, token batch 256
TABLE11_METHODS = {"full": "AdamW", "adam8bit": "Adam8bit", "galore_8bit": "8-bit GaLore"}


def parse_memory(text: str) -> int:
    """'24GB', '24 GB', '24GiB', '16000MB' -> bytes (GB = 1e9, GiB = 2**30)."""
    value = size(text, bare=False) or 0.0
    if value < 1:  # 0.1B is no byte
        raise UserError(f"--memory: '{text}' is not a memory size (e.g. 24GB, 24 GB, 24GiB, "
                        "16000MB; GB = 1e9 bytes, GiB = 2^30)")
    return int(value)


@dataclass
class Candidate:
    label: str  # the method entry: a registered method, or a variant such as galore_8bit
    method: str
    settings: dict[str, Any]
    modifiers: str
    memory: dict[str, Any]  # the run's memory section
    precision: str
    micro_batch: int
    accumulation: int
    peak_bytes: int = 0
    cost: float = 0.0
    recompute_forwards: float = 0.0  # extra forward passes, as a fraction of one
    transfer_bytes: int = 0  # over the host link per step
    tok_s: float | None = None  # measured, where a source has this configuration
    tok_s_source: str = ""
    fits: bool = False
    breakdown: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    budget: int
    fits: list[Candidate]  # sorted by cost, then peak: the first is the fastest that fits
    closest: list[Candidate]  # when nothing fits: the smallest peaks
    refused: dict[str, str]  # combination -> why it was skipped
    gpus: int = 1  # more than one: each holds its fsdp share; `budget` is one GPU's
    unusable: dict[str, str] = field(default_factory=dict)  # method entry -> why none of it ran
    # method entry -> why it is not for pretraining from scratch (`Method.tasks`): left out
    apart: dict[str, str] = field(default_factory=dict)
    nodes: int = 1  # more than one: hsdp, each GPU its share of its node's (a shard group)


def method_entries(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every registered method at its defaults (the paper's rank for the preset), plus
    VARIANTS."""
    entries = {name: (name, {}) for name in method_names()} | VARIANTS
    hidden = architecture(model).hidden
    out = {}
    for label, (name, settings) in entries.items():
        fields = get_method(name).Config.model_fields
        if "rank" in fields:
            rank = PAPER_RANKS.get(model, min(fields["rank"].default, hidden // 4))
            settings = {"rank": rank, **settings}
        out[label] = (name, settings)
    return out


def candidates(model: str, seq_len: int, token_batch: int) -> list[Candidate]:
    sequences, rest = divmod(token_batch, seq_len)
    if rest or not sequences:
        raise UserError(f"--token-batch {token_batch} is not a whole number of sequences of "
                        f"--seq-len {seq_len}")
    micro = [m for m in range(sequences, 0, -1) if sequences % m == 0]
    return [Candidate(label, name, settings, " + ".join(filter(None, (act, opt))),
                      {**ACTIVATION_MODIFIERS[act], **OPTIMIZER_MODIFIERS[opt]}, precision,
                      m, sequences // m)
            for label, (name, settings) in method_entries(model).items()
            for act in ACTIVATION_MODIFIERS for opt in OPTIMIZER_MODIFIERS
            for precision in PRECISIONS for m in micro]  # fmt: skip


def run_of(c: Candidate, model: str, seq_len: int, tokenizer: str, gpus: int = 1,
           nodes: int = 1):
    """The candidate's run; on more than one GPU sharded with FSDP2, each GPU taking its
    micro-batches of the step: over all of them (fsdp), or on several nodes within each node,
    the nodes replicating each other (hsdp)."""
    return load_run({
        "model": model, "device": "cuda",
        "task": {"seq_len": seq_len, "tokenizer": tokenizer},
        "train": {**PRECISIONS[c.precision], "batch_size": c.micro_batch,
                  "total_batch_size": c.micro_batch * c.accumulation * gpus,
                  **parallel_keys(gpus, nodes)},
        "memory": c.memory, "method": {"name": c.method, **c.settings},
    })  # fmt: skip


def parallel_keys(gpus: int, nodes: int) -> dict[str, Any]:
    """The train keys of `gpus` GPUs on `nodes` nodes: one GPU none, one node fsdp, several
    hsdp sharded within a node; refuses nodes that do not hold the GPUs equally."""
    if gpus % nodes:
        allowed = ", ".join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)
        raise UserError(f"--nodes {nodes} does not split --gpus {gpus} into whole nodes of "
                        f"equal GPUs; allowed: {allowed}")
    if gpus == 1:
        return {}
    return {"parallel": "fsdp"} if nodes == 1 else {"parallel": "hsdp",
                                                     "shard_group": gpus // nodes}


def plan(model: str, budget: int, seq_len: int = 256, token_batch: int = 256,
         tokenizer: str = "t5-base", closest: int = 5, gpus: int = 1, nodes: int = 1) -> Plan:
    """`token_batch`: tokens a GPU takes each step; `gpus` > 1: each GPU holds its fsdp share
    (harness/cost/sharded.py), `budget` is one GPU's; `nodes` > 1: the GPUs are that many
    nodes' (hsdp), each GPU holding its share of its node's."""
    parallel_keys(gpus, nodes)  # the shape, checked before any candidate
    longest = architecture(model).max_seq_len
    if seq_len > longest:
        raise UserError(f"--seq-len {seq_len}: {model} takes at most {longest}")
    apart = {label: get_method(name).tasks_note for label, (name, _) in
             method_entries(model).items() if "pretrain" not in get_method(name).tasks}
    base, loaded = None, False
    evaluated, refused = [], {}
    estimated: dict[str, Any] = {}  # what runs differing only in activation modifiers share
    worked: dict[str, Any] = {}
    for c in candidates(model, seq_len, token_batch):
        try:
            run = run_of(c, model, seq_len, tokenizer, gpus, nodes)
        except UserError as e:
            refused.setdefault(f"{c.label} [{c.modifiers or 'none'}] {c.precision}", str(e))
            continue
        loaded = True
        if c.label in apart:  # listed apart, not ranked: no estimate to throw away
            continue
        if base is None:  # full AdamW, bf16-mixed, no modifier, one micro-batch
            whole = Candidate("full", "full", {}, "", {}, "bf16-mixed", token_batch // seq_len, 1)
            base = step_work(run_of(whole, model, seq_len, tokenizer, gpus, nodes), gpus)[2]
        record = estimate_run(run, gpus, estimated)
        c.peak_bytes = record["peak_bytes"] - on_host(run, record)
        c.breakdown = {k: record[k] for k in BREAKDOWN}
        c.recompute_forwards, c.transfer_bytes, seconds = step_work(run, gpus, worked)
        c.cost = seconds / base
        c.fits = c.peak_bytes <= budget
        evaluated.append(c)
    if not loaded:  # a setting every candidate shares is wrong (e.g. --seq-len 1)
        raise UserError(next(iter(refused.values())))
    fits = _fastest_micro_batch([c for c in evaluated if c.fits])
    fits.sort(key=lambda c: (round(c.cost, 4), c.peak_bytes, c.label, len(c.modifiers)))
    fits = _distinct(fits)
    near = [] if fits else sorted(evaluated, key=lambda c: c.peak_bytes)[:closest]
    if gpus == 1:  # Table 11's figures are one GPU's
        _measured(fits + near, model, seq_len, token_batch)
    ran = {c.label for c in evaluated}
    unusable = {}
    for combination, why in refused.items():
        label = combination.split(" [")[0]
        if label not in ran and label not in apart:
            unusable.setdefault(label, why)
    return Plan(budget, fits, near, refused, gpus, unusable, apart, nodes)


def on_host(run: Any, record: dict[str, Any]) -> int:
    """Bytes `optimizer_offload: host` keeps off the GPU: the optimizer states, and under fsdp
    or hsdp (FSDP's CPU offload) the weight and gradient shards too."""
    if run.memory.optimizer_offload != "host":
        return 0
    sharded = run.train.sharded
    return record["optimizer_state_bytes"] + (
        record["weight_bytes"] + record["grad_bytes"] if sharded else 0)


def step_work(run: Any, gpus: int = 1, memo: dict[str, Any] | None = None
              ) -> tuple[float, int, float]:
    """A step's extra forward passes (a fraction of one), bytes over the host link, and its
    seconds on DEVICE under the cost model (the module's docstring): one GPU's share. `memo`
    keeps the method's FLOPs and trained elements for the next run that differs only in its
    activation modifiers, as `estimate_run`'s does its bytes."""
    seq_len, layers = run.task.seq_len, architecture(run.model).layers
    shapes = run_shapes(run)
    steps = Steps.of(run.train, seq_len, gpus)
    memory = build_memory(run, steps)
    host = run.memory.optimizer_offload == "host"  # the only user of the trained elements
    flops, trained = memoized(memo, run, gpus, lambda: (
        forward_flops(shapes, memory, seq_len), trained_numel(shapes, memory) if host else 0))
    layer = flops["attention"] + flops["mlp"]
    forward = layer * layers + flops["head"]
    recomputed = ("attention", "mlp") if run.memory.recompute == "full" else run.memory.recomputed
    extra_forwards = sum(flops[k] for k in recomputed) * layers / forward
    backward = (layer * layers * (1 if memory.linears == "adapter" else 2)  # frozen base: no dW
                + flops["head"] * (2 if trains_norms(memory) else 1))
    transfers = 0
    if run.memory.offloaded:  # to the host in forward, back in backward, every micro-batch
        kept = run.model_copy(update={"memory": run.memory.model_copy(update={"offload": "none"})})
        moved = (activations(kept, shapes, memory, "cuda").start
                 - activations(run, shapes, memory, "cuda").start)
        transfers += 2 * moved * steps.accumulation
    if host:  # gradients down, weights back up
        w = widths(run)
        transfers += trained * (w.grad + w.weight)
    rate = DEVICE.fp32_flops if run.train.precision == "32-true" else DEVICE.bf16_flops
    seconds = (steps.tokens * (forward * (1 + extra_forwards) + backward) / rate
               + transfers / DEVICE.host_bytes_s
               + steps.accumulation * layers * DEVICE.launch_s)
    return extra_forwards, transfers, seconds


def trained_numel(shapes: dict[str, Any], memory: Memory) -> int:
    """Elements the optimizer updates: adapters or factors (rank r: r(m+n)) in place of
    their target linears, the other tensors unless the method freezes them."""
    rank = getattr(memory.config, "rank", 0)
    total = 0
    for name, shape in shapes.items():
        if len(shape) == 2 and is_target(name.rpartition(".")[0], targets(memory)):
            low = memory.linears in ("adapter", "factored")
            total += rank * sum(shape) if low else numel(shape)
        elif trains_norms(memory):
            total += numel(shape)
    return total


def forward_flops(shapes: dict[str, Any], memory: Memory, seq_len: int) -> dict[str, float]:
    """Forward FLOPs a token, by kind: one decoder layer's attention and MLP, and the head."""
    rank = getattr(memory.config, "rank", 0)
    out = {}
    for kind, names in KIND_LINEARS.items():
        if kind == "norm":
            continue
        flops = 0.0
        for name, shape in shapes.items():
            module = name.rpartition(".")[0]
            if ".layers.0." not in name or len(shape) != 2 or not is_target(module, names):
                continue
            m, n = shape
            own = is_target(module, targets(memory))
            if own and memory.linears == "factored":
                flops += 2 * rank * (m + n)
            else:
                flops += 2 * m * n + (2 * rank * (m + n) if own and memory.linears == "adapter"
                                      else 0)
        out[kind] = flops
    # QKᵀ and AV, halved by causality, over the queries' width (heads · head_dim)
    out["attention"] += 2 * seq_len * shapes["model.layers.0.self_attn.q_proj.weight"][0]
    out["head"] = 2 * numel(head_shape(shapes))
    return out


def _fastest_micro_batch(fits: list[Candidate]) -> list[Candidate]:
    """One row per method, modifiers and precision: its largest micro-batch that fits."""
    best: dict[tuple[str, str, str], Candidate] = {}
    for c in fits:
        key = (c.label, c.modifiers, c.precision)
        if key not in best or c.micro_batch > best[key].micro_batch:
            best[key] = c
    return list(best.values())


def _distinct(rows: list[Candidate]) -> list[Candidate]:
    """Drop a row that only adds a modifier with no effect (Q-GaLore is layer-wise anyway)."""
    seen, out = set(), []
    for c in rows:
        key = (c.label, c.precision, c.micro_batch, c.peak_bytes, round(c.cost, 4))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _measured(rows: list[Candidate], model: str, seq_len: int, token_batch: int) -> None:
    """tok/s where a machine-readable measurement of this configuration exists: GaLore's
    Table 11 (LLaMA-1B, token batch 256, pure bf16, no activation modifier). The harness's
    own CPU figures (docs/benchmarks.md) are prose tables, not read here."""
    if model != "llama_1b" or (seq_len, token_batch) != (256, 256):
        return
    text = resources.files("harness.analysis").joinpath(TABLE11_CSV).read_text()
    table = {(r["method"], r["layerwise"] == "true"): float(r["tokens_per_s"])
             for r in csv.DictReader(text.splitlines())}  # fmt: skip
    for c in rows:
        key = (TABLE11_METHODS.get(c.label, ""), c.modifiers == "layerwise")
        pure = c.precision.startswith("bf16-true")
        if pure and c.modifiers in ("", "layerwise") and key in table:
            c.tok_s, c.tok_s_source = table[key], "GaLore Table 11"
