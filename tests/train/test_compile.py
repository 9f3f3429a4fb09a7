"""train.compile: each decoder layer and the loss's head as one graph each, traced for every
method and modifier that can be (torch._dynamo.explain, no C++ build), the rest refused at
load; and trainings compiled against eager (the C++ build: integration tier, tests/tiers.py).

The traced graphs are the model's forward and loss: a method reaches them only through its
`prepare` hook, never through its optimizer (which gets the parameters, not the modules). So
every method that changes the model (tests/method_matrix.py's MODEL_METHODS, full among them)
is traced with every modifier, and a method that keeps the model as built traces full's graphs:
it is loaded with every modifier (a refusal would show), not traced again."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import micro_run, train_losses
from method_matrix import METHODS, MODEL_METHODS, MODIFIERS, REFUSED
from safetensors import safe_open
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.modifiers.recompute import decoder_layers
from harness.train import compiled, setup, train
from harness.trials import read_jsonl

# The modifiers a compiled run can take (offload is refused, below), and the precisions.
TRACED = {name: sections for name, sections in MODIFIERS.items() if name != "offload_mlp"}
TRACED |= {"bf16_mixed": {"train": {"precision": "bf16-mixed"}},
           "loss_chunk": {"train": {"loss_chunk": 16}}}
# Q-GaLore's INT8 layers update inside backward (refused); its simulated form traces.
COMPILE_METHODS = {**{m: s for m, s in METHODS.items() if m != "qgalore"},
                   "qgalore_simulated": {**METHODS["qgalore"], "simulate": True}}
PAIRS = [(m, x) for m in COMPILE_METHODS for x in TRACED
         if (m.removesuffix("_simulated"), x) not in REFUSED
         and not (m == "qgalore_simulated" and TRACED[x].get("memory", {}).get("layerwise"))]
CASES = [(m, x) for m, x in PAIRS if m.removesuffix("_simulated") in MODEL_METHODS]  # traced


def _diagonal() -> set[tuple[str, str]]:
    """Each traced method with one modifier, the modifiers in turn, and full with any modifier
    left over (every one at least once)."""
    order = list(TRACED)
    picked, turn = set(), 0
    for method in dict.fromkeys(m for m, _ in CASES):
        while (method, order[turn % len(order)]) not in CASES:
            turn += 1
        picked.add((method, order[turn % len(order)]))
        turn += 1
    return picked | {("full", x) for x in TRACED if x not in {y for _, y in picked}}


QUICK = {"test_each_layer_and_the_loss_trace_as_one_graph": _diagonal()}  # rest: integration
# Layer-wise updates hook the parameters and bfloat16 states live in the optimizer: neither
# reaches the traced forward and loss, so a method's layer-wise case traces its optimizer
# offload case's graphs (with full's layer-wise case tracing past the hooks), and its
# bf16-true-with-bfloat16-states case its bf16-true Kahan one's. `pytest --exhaustive` runs them.
EXHAUSTIVE = {"test_each_layer_and_the_loss_trace_as_one_graph": {
    (m, x) for m, x in CASES if m != "full" and x in ("layerwise", "bf16_true_bf16_states")
    and (m, "bf16_true_kahan" if x.startswith("bf16") else "optimizer_offload") in CASES
} - _diagonal()}
# Compiled against eager, llama_tiny, layer-wise, one sequence a step (the trainings below): the
# step losses differed by up to 4.3e-7 relative over 3 steps, the eval loss by 3.8e-8, so the
# tolerance is ten times the largest, rounded up. The peak of live tensors was 0.6% below
# eager's, where compiling forward and loss as one graph was 17% above (as high as without
# layer-wise updates): a compiled peak may exceed eager's by 2%.
LOSS_RTOL = 5e-6
PEAK_SLACK = 0.02


def run_config(method: str, modifier: str) -> dict[str, Any]:
    data = micro_run(steps=2, compile=True)
    data["method"] = COMPILE_METHODS[method]
    data["train"].update(TRACED[modifier].get("train", {}))
    data["memory"] = TRACED[modifier].get("memory", {})
    return data


def calls(model: torch.nn.Module, data: Any) -> dict[str, tuple[tuple, dict]]:
    """Each compile target's arguments in one eager forward of a batch."""
    seen: dict[str, tuple[tuple, dict]] = {}
    first = decoder_layers(model)[0]
    handle = first.register_forward_pre_hook(
        lambda _, args, kwargs: seen.setdefault("layer0", (args, kwargs)), with_kwargs=True)
    head = getattr(data, "head_loss", None)  # GLUE's classifier loss: none, eager

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.setdefault("loss", (args, kwargs))
        return head(*args, **kwargs)  # type: ignore[misc]

    if head is not None:
        data.head_loss = recorded
    try:
        data.loss(model, data.next()[0])
    finally:
        handle.remove()
        if head is not None:
            data.head_loss = head
    return seen


def assert_traced(config: dict[str, Any], names: set[str]) -> None:
    """Dynamo traces the first layer (after recompute wrapped it and the method prepared it;
    every layer is the same code) and the head loss without a graph break, as `fullgraph=True`
    then compiles them; `names`: the targets, less the other layers."""
    run = load_run(config)
    steps, device = setup.join(run)
    model, _, data = setup.model(run, steps, device)
    try:
        chosen = setup.method(run, steps, model)[0]
        model = setup.modifiers(model, chosen, run, device)[0]
        setup.optimizer(chosen, model, run, device)  # layer-wise: its hooks, in place
        compiled.trace_settings()
        seen = calls(model, data)
        targets = compiled.targets(model, data)
        assert set(seen) == names == set(targets) - {
            f"layer{i}" for i in range(1, len(decoder_layers(model)))}
        for name, (args, kwargs) in seen.items():
            explained = torch._dynamo.explain(targets[name])(*args, **kwargs)
            assert explained.graph_break_count == 0, (name, explained.break_reasons)
            assert explained.graph_count == 1, name
    finally:
        data.close()


@pytest.mark.parametrize(("method", "modifier"), CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_each_layer_and_the_loss_trace_as_one_graph(method, modifier):
    assert_traced(run_config(method, modifier), {"layer0", "loss"})


def test_a_method_that_keeps_the_model_is_accepted_compiled_with_every_modifier():
    """The pairs not traced (the module docstring): each loads with train.compile on."""
    untraced = [(m, x) for m, x in PAIRS if (m, x) not in CASES]
    assert {m for m, _ in untraced} == set(COMPILE_METHODS) - {"qgalore_simulated"} - set(
        MODEL_METHODS)
    for method, modifier in untraced:
        assert load_run(run_config(method, modifier)).train.compile, (method, modifier)


def test_a_glue_models_layers_trace_as_one_graph():
    """Fine-tuning's classifier head and loss stay eager; its encoder's layers compile."""
    data = micro_run(batch_size=4, total_batch_size=4, compile=True)
    data["task"] = {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48}
    assert_traced(data, {"layer0"})


@pytest.mark.parametrize(("method", "memory", "named"), [
    ("full", {"offload": ["mlp"]}, "train.compile with memory.offload"),
    ("qgalore", {}, "method qgalore with train.compile"),
    ("apollo", {}, "method apollo with train.compile"),
])
def test_what_cannot_be_traced_is_refused_in_one_line(method, memory, named):
    data = micro_run(compile=True)
    data["method"] = {"name": method, **({"int8_weights": True} if method == "apollo" else {})}
    data["memory"] = memory
    with pytest.raises(UserError) as refused:
        load_run(data)
    assert named in str(refused.value) and "train.compile: false" in str(refused.value)
    assert "\n" not in str(refused.value)
    data["train"]["compile"] = False
    load_run(data)  # eager: allowed


def test_a_sweeps_trials_share_its_compile_cache_and_a_lone_run_keeps_its_own(tmp_path):
    (tmp_path / "sweep.yaml").write_text("name: s\n")
    assert compiled.cache_folder(tmp_path / "trials" / "t3") == tmp_path / "compile_cache"
    alone = tmp_path / "runs" / "mine"
    assert compiled.cache_folder(alone) == alone / "compile_cache"
    assert compiled.cache_folder(tmp_path / "other" / "t3") == tmp_path / "other" / "t3" / (
        "compile_cache")  # no sweep around it


def test_the_compile_cache_follows_the_trial_unless_the_environment_names_one(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as torch's import sets
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compiled.keep_cache(tmp_path)
    assert Path(cache_dir()) == tmp_path / "compile_cache"  # where inductor writes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/t")
    compiled.keep_cache(tmp_path / "b")
    assert (os.environ["TORCHINDUCTOR_CACHE_DIR"],
            os.environ["TRITON_CACHE_DIR"]) == ("/elsewhere", "/elsewhere/t")


def test_the_compile_step_compiles_in_place_only_when_asked(tmp_path, monkeypatch):
    """Layers compiled in place (the same objects, the same state_dict keys), the head loss
    replaced by its compiled form, the cache in the run's folder; nothing when compile is off."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # restored afterwards
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    for on in (False, True):
        run = load_run(micro_run(compile=on))
        steps, device = setup.join(run)
        model, _, data = setup.model(run, steps, device)
        try:
            keys, head = list(model.state_dict()), data.head_loss
            assert setup.compile_model(model, data, run.train, tmp_path) == data.loss
            cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            assert (cache == tmp_path / "compile_cache") == on
            layers = decoder_layers(model)
            assert all((layer._compiled_call_impl is not None) == on for layer in layers)
            assert (data.head_loss is not head) == on
            assert getattr(data.head_loss, "_torchdynamo_orig_callable", head) is head
            assert list(model.state_dict()) == keys
        finally:
            data.close()


# -- trainings: inductor's C++ build (integration tier) -------------------------------------


def trial_config(compile_on: bool) -> dict[str, Any]:
    """3 steps of llama_tiny with layer-wise updates, whose memory saving compile must keep:
    one sequence a step (no accumulation, which keeps every gradient until the last
    micro-batch), so the peak is the update's, not the activations' (llama_micro's are)."""
    data = micro_run(steps=3, compile=compile_on, keep_final="full", batch_size=1,
                     total_batch_size=1)
    data["model"] = "llama_tiny"
    data["eval"] = {"every": 0, "tokens": 256}
    data["memory"] = {"layerwise": True}
    return data


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An eager trial, then two identical compiled ones in one sweep folder (the second reads
    what the first compiled): their folders, summaries and inductor's cache counters."""
    root = tmp_path_factory.mktemp("compile")
    (root / "sweep.yaml").write_text("name: compile\n")
    folders = {"eager": root / "eager", "t1": root / "trials" / "t1", "t2": root / "trials" / "t2"}
    out: dict[str, Any] = {"folders": folders, "root": root}
    with pytest.MonkeyPatch.context() as patch:  # as a fresh trial process starts
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        patch.delenv("TRITON_CACHE_DIR", raising=False)
        for name, folder in folders.items():
            torch._dynamo.reset()  # a trial process starts with no graphs in memory
            counters.clear()
            out[name] = train(load_run(trial_config(name != "eager")), folder)
            out[f"{name}_cache"] = dict(counters["inductor"])
    return out


def test_compiled_losses_equal_eager_within_the_measured_spread(trials):
    """Inductor fuses and reorders float32 sums: losses move by rounding (LOSS_RTOL)."""
    eager, compiled_ = (train_losses(trials["folders"][k]) for k in ("eager", "t1"))
    assert list(compiled_) == list(eager) == [1, 2, 3]
    assert list(compiled_.values()) == pytest.approx(list(eager.values()), rel=LOSS_RTOL, abs=0)
    assert math.isclose(trials["t1"]["eval_loss"], trials["eager"]["eval_loss"], rel_tol=LOSS_RTOL)


def test_compiled_layerwise_updates_keep_their_memory_saving(trials):
    """The peak of live tensors (the profiler's, in a steady step) compiled per layer is the
    eager one's: each layer's backward hands its gradients to the layer-wise hooks as it ends.
    Compiling forward and loss as one graph made every gradient at once (measured +17% on
    llama_tiny); per layer the peak is within PEAK_SLACK of eager's."""
    eager, compiled_ = trials["eager"], trials["t1"]
    assert compiled_["grad_bytes"] == eager["grad_bytes"]
    assert compiled_["peak_memory_bytes"] <= eager["peak_memory_bytes"] * (1 + PEAK_SLACK)


def test_a_compiled_checkpoint_loads_into_an_eager_model_and_back(trials):
    """The same state_dict keys compiled or not: either trial's weights load strictly into
    the other kind's model, and the exported Hugging Face model has the same tensors' names."""
    folders = trials["folders"]
    states = {k: torch.load(folders[k] / "checkpoint" / "state.pt", weights_only=False)["model"]
              for k in ("eager", "t1")}
    for mine, other in (("eager", "t1"), ("t1", "eager")):
        run = load_run(trial_config(mine == "t1"))
        steps, device = setup.join(run)
        model, _, data = setup.model(run, steps, device)
        try:
            setup.compile_model(model, data, run.train, folders[mine])
            model.load_state_dict(states[other], strict=True)
            assert all(torch.equal(t, states[other][k]) for k, t in model.state_dict().items())
        finally:
            data.close()
    exported = {k: safe_open_keys(folders[k] / "model") for k in ("eager", "t1")}
    assert exported["eager"] == exported["t1"] and exported["eager"]


def safe_open_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_a_second_identical_trial_reads_the_first_ones_compiled_graphs(trials):
    """The sweep's trials share its compile cache: the first compiles (misses), the second
    finds every graph there (hits, no miss)."""
    first, second = trials["t1_cache"], trials["t2_cache"]
    assert first.get("fxgraph_cache_miss", 0) > 0
    assert second.get("fxgraph_cache_hit", 0) > 0 and second.get("fxgraph_cache_miss", 0) == 0
    assert (trials["root"] / "compile_cache").is_dir()
    assert not (trials["folders"]["t1"] / "compile_cache").exists()


def test_compile_time_is_reported_apart_from_tok_s(trials):
    """compile_s is the first step's time beyond a steady one's, from the logged step times
    (log_every 1: each line one step); tokens_per_s counts steps 2 and 3 only."""
    lines = [r for r in read_jsonl(trials["folders"]["t1"] / "metrics.jsonl")
             if r["kind"] == "train"]
    first, *steady = [r["step_time_s"] for r in lines]
    expected = first - sum(steady) / len(steady)
    assert trials["t1"]["compile_s"] == pytest.approx(expected, rel=1e-6)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in lines[1:])
    assert trials["t1"]["tokens_per_s"] == pytest.approx(tokens / sum(steady), rel=1e-6)
    assert trials["eager"].get("compile_s") is None
