"""Construction on the meta device under fsdp (harness/distributed/materialize.py): each rank
holds its rows of the very weights the ordinary CPU build draws, bitwise, and the generator ends
where that build leaves it; the model is never whole on a rank, so its peak memory at start
falls with the ranks."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_port, micro_run, write_yaml
from meta_sources import as_bin, encoder_folder, glue, qwen2, seeded, with_weights
from ranks import Ranks

from harness.config.steps import Steps
from harness.distributed.materialize import Twins, Unsupported
from harness.distributed.weights import Weights
from harness.methods import build_method
from harness.methods.resolve import load_run
from harness.train import pretrain, setup

METHODS = {
    "full": {"name": "full"}, "lora": {"name": "lora", "rank": 4},
    "lowrank": {"name": "lowrank", "rank": 8}, "galore": {"name": "galore", "rank": 8},
    "relora": {"name": "relora", "rank": 4, "reset_every": 2, "restart_warmup_steps": 1},
    "apollo": {"name": "apollo", "rank": 8}, "fira": {"name": "fira", "rank": 8},
    "muon": {"name": "muon"}, "adam_mini": {"name": "adam_mini"},
    "adam8bit": {"name": "adam8bit"}, "apollo_mini": {"name": "apollo_mini"},
    "relora_lora_init": {"name": "relora", "rank": 4, "init": "lora"},
}


def whole(run: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """The ordinary build and `prepare` on the CPU, and the generator after."""
    seeded(run.seed)
    model = pretrain.build(run)[0]
    model = build_method(run, Steps.of(run.train, run.task.seq_len)).prepare(model, run)
    return model, torch.get_rng_state()


def twinned(run: Any, rank: int, world: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same on the meta device as rank `rank` of `world` twins it: its rows of each
    parameter, each buffer whole."""
    seeded(run.seed)
    twins = Twins(rank, world)
    model = twins.run(pretrain.build, run)[0]
    chosen = build_method(run, Steps.of(run.train, run.task.seq_len))
    model = twins.run(chosen.prepare, model, run)
    assert all(p.is_meta for p in model.parameters())
    return twins.values(model), torch.get_rng_state()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_ranks_twins_are_its_rows_of_the_cpu_build_bitwise(method):
    """Three ranks (71-row and 64-row tensors split unevenly, one norm of 64 too): each holds
    rows [r·c, r·c + c) of the CPU build's tensors, c = ceil(m / 3), and draws as much."""
    run = load_run({**micro_run(), "method": METHODS[method]})
    cpu, generator = whole(run)
    params, buffers = dict(cpu.named_parameters()), dict(cpu.named_buffers())
    for rank in range(3):
        rows, after = twinned(run, rank, 3)
        assert torch.equal(after, generator)  # the same draws: what follows draws the same
        assert rows.keys() == params.keys() | buffers.keys()
        for name, p in params.items():
            c, m = -(-p.shape[0] // 3), p.shape[0]
            assert torch.equal(rows[name], p.detach()[min(rank * c, m):min(rank * c + c, m)]), \
                (method, rank, name)
        for name, b in buffers.items():  # not sharded: whole on every rank
            assert torch.equal(rows[name], b), (method, rank, name)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_an_hf_configs_twins_are_its_rows_too(tmp_path, family):
    """A config without weights, drawn as transformers draws it: Qwen2's q/k/v biases (1-D
    rows of their own) and its tied head (one parameter under two names)."""
    run = load_run({**micro_run(), "model": qwen2(tmp_path, family), "method": METHODS["lora"]})
    cpu, generator = whole(run)
    for rank in range(2):
        rows, after = twinned(run, rank, 2)
        assert torch.equal(after, generator)
        for name, p in cpu.named_parameters():
            c = -(-p.shape[0] // 2)
            assert torch.equal(rows[name], p.detach()[rank * c:rank * c + c]), (rank, name)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_a_models_weights_are_read_as_each_ranks_rows_bitwise(tmp_path, family):
    """Continued pretraining: the skeleton built on the meta device draws nothing (nor does
    from_pretrained), each rank reads only its rows of the safetensors file, and LoRA's
    adapters are then drawn from where the ordinary build leaves the generator."""
    run = load_run({**micro_run(), "model": with_weights(tmp_path, family),
                    "method": METHODS["lora"]})
    cpu, generator = whole(run)
    files = sorted(Path(run.model).glob("*.safetensors"))
    for rank in range(2):
        seeded(run.seed)
        twins = Twins(rank, 2)
        model = twins.run(partial(pretrain.build, run, skeleton=True), draw=False)[0]
        twins.read_rows(model, Weights(files))
        chosen = build_method(run, Steps.of(run.train, run.task.seq_len))
        rows = twins.values(twins.run(chosen.prepare, model, run))
        assert torch.equal(torch.get_rng_state(), generator)
        for name, p in cpu.named_parameters():
            c = -(-p.shape[0] // 2)
            assert torch.equal(rows[name], p.detach()[rank * c:rank * c + c]), (rank, name)
        for name, b in cpu.named_buffers():
            assert torch.equal(rows[name], b), (rank, name)


def test_weights_the_files_lack_are_unsupported(tmp_path):
    """A parameter no file holds (here: the files of another model) cannot be read by rows."""
    run = load_run({**micro_run(), "model": with_weights(tmp_path, "mistral")})
    other = Path(with_weights(tmp_path / "other", "qwen2"))
    twins = Twins(0, 2)
    model = twins.run(partial(pretrain.build, run, skeleton=True), draw=False)[0]
    with pytest.raises(Unsupported, match=r"no weight lm_head\.weight"):
        twins.read_rows(model, Weights(sorted(other.glob("*.safetensors"))))


def test_bf16_true_casts_the_twins_as_the_cpu_build_casts_its_weights():
    run = load_run({**micro_run(precision="bf16-true"), "method": METHODS["full"]})
    seeded(run.seed)
    cpu = pretrain.build(run)[0].to(torch.bfloat16)
    seeded(run.seed)
    twins = Twins(1, 2)
    model = twins.run(lambda: pretrain.build(run)[0].to(torch.bfloat16))
    rows = twins.values(model)
    for name, p in cpu.named_parameters():
        c = -(-p.shape[0] // 2)
        assert rows[name].dtype == torch.bfloat16
        assert torch.equal(rows[name], p.detach()[c:2 * c]), name


def test_an_op_that_needs_a_whole_parameter_is_unsupported():
    """A product reads every row of a weight: no rank can compute it from its own rows."""
    run = load_run(micro_run())
    seeded(run.seed)
    twins = Twins(0, 2)
    model = twins.run(pretrain.build, run)[0]
    weight = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(Unsupported):
        twins.run(lambda: weight @ weight.T)


def test_a_prepare_the_twins_cannot_follow_falls_back_to_the_whole_build(monkeypatch):
    """A `prepare` that reads a whole weight (its sum): the trainer's step builds the model the
    ordinary way instead, from the seed, bitwise the CPU build, the generator where it left it."""
    run = load_run(micro_run())
    chosen = build_method(run, Steps.of(run.train, run.task.seq_len))

    def reads_whole(model: torch.nn.Module, run: Any) -> torch.nn.Module:
        model.lm_head.weight.sum()  # a reduction over every row
        return model

    monkeypatch.setattr(chosen, "prepare", reads_whole)
    seeded(run.seed)
    reference = chosen.prepare(pretrain.build(run)[0], run)
    generator = torch.get_rng_state()
    seeded(run.seed)
    twins = Twins(1, 2)
    meta = twins.run(pretrain.build, run)[0]
    deferred = setup.Deferred(twins, partial(pretrain.build, run))
    monkeypatch.setitem(setup._deferred, meta, deferred)
    model, _ = setup.modifiers(meta, chosen, run, torch.device("cpu"))
    assert model is not meta and not any(p.is_meta for p in model.parameters())
    state = model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in reference.state_dict().items())
    assert torch.equal(torch.get_rng_state(), generator)

def launch(mode: str, tmp_path: Path, procs: int, configs: list[Path]) -> list[dict[str, Any]]:
    argv = [mode, str(tmp_path), *map(str, configs)]
    ranks = Ranks(argv, procs, free_port(), module="meta_init_ranks")
    out, _ = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, out[-3000:]
    return json.loads((tmp_path / f"{mode}.json").read_text())


def test_sharded_setup_builds_on_meta_and_equals_the_whole_build_bitwise(tmp_path):
    """Two ranks, the trainer's setup steps (model, method, modifiers, parallelize) under fsdp,
    each method's weights gathered against the same rank's ordinary whole build; last, a GLUE
    classifier whose body is a pytorch_model.bin."""
    cases = ["full", "lora", "lowrank", "galore", "relora", "muon"]
    configs = [write_yaml(tmp_path / f"{m}.yaml",
                          {**micro_run(parallel="fsdp"), "method": METHODS[m]}) for m in cases]
    configs.append(write_yaml(tmp_path / "bf16.yaml", {
        **micro_run(parallel="fsdp", precision="bf16-true"), "method": METHODS["galore"]}))
    configs.append(write_yaml(tmp_path / "qwen2.yaml", {
        **micro_run(parallel="fsdp"), "model": qwen2(tmp_path), "method": METHODS["lora"]}))
    configs.append(write_yaml(tmp_path / "weights.yaml", {
        **micro_run(parallel="fsdp"), "model": with_weights(tmp_path, "qwen2"),
        "method": METHODS["lora"]}))
    body = as_bin(Path(encoder_folder(tmp_path, "llama")), 1)
    configs.append(write_yaml(tmp_path / "glue.yaml", glue(str(body), parallel="fsdp")))
    for rank, results in enumerate(launch("equal", tmp_path, 2, configs)):
        for case, got in results.items():
            assert got["meta"], (rank, case)  # on the meta device until sharded
            assert got["differ"] == [] and got["keys"] > 20, (rank, case)
            assert got["generator"], (rank, case)


# A model far larger than llama_micro: llama_130m at the sample tokenizer's vocabulary, 0.39 GB
# in float32 (85M parameters in its decoder layers alone: 12 × (4·768² + 3·768·2048)).
BIG = {**micro_run(parallel="fsdp", batch_size=1, total_batch_size=4), "model": "llama_130m"}
BIG_LAYERS = 12 * (4 * 768**2 + 3 * 768 * 2048) * 4


def test_a_ranks_peak_memory_at_start_is_a_quarter_of_one_process_plus_a_constant(tmp_path):
    """Growth of resident memory from before the build to the sharded model. One process grows
    by the whole model plus what any process adds (data, tokenizer: `other`, measured there);
    each of 4 ranks by its quarter of the model, `other`, and what it holds whole at once: the
    scratch its draws go to, as large as the largest tensor (the embedding), and 32 MiB of the
    allocator's and FSDP's slack (measured: under 10)."""
    one = launch("rss", tmp_path, 1, [write_yaml(tmp_path / "big.yaml", BIG)])[0]["big"]
    four = [r["big"] for r in launch("rss", tmp_path, 4, [tmp_path / "big.yaml"])]
    print(json.dumps({"one": one, "four": four}))  # the figures docs/scale-out.md gives
    model = one["held_bytes"]  # one process holds it all
    grown_one = (one["peak_kib"] - one["before_kib"]) * 1024
    assert not one["meta"] and model > BIG_LAYERS and grown_one >= model
    other = grown_one - model
    for rank in four:
        grown = (rank["peak_kib"] - rank["before_kib"]) * 1024
        assert rank["meta"] and rank["held_bytes"] <= -(-model // 4) + 2**20
        assert grown <= model / 4 + other + rank["largest_bytes"] + 32 * 2**20, (grown, one)
