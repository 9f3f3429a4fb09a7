"""Construction on the meta device under fsdp (harness/distributed/materialize.py): each rank
holds its rows of the very weights the ordinary CPU build draws, bitwise, and the generator ends
where that build leaves it; the model is never whole on a rank, so its peak memory at start
falls with the ranks."""

from __future__ import annotations

import json
import random
import shutil
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import free_port, micro_run, write_yaml
from huggingface_hub import constants
from ranks import Ranks

from harness.config.steps import Steps
from harness.data.c4 import SAMPLE
from harness.distributed.materialize import Twins, Unsupported
from harness.distributed.weights import Weights
from harness.methods import build_method
from harness.methods.resolve import load_run
from harness.train import classifier, finetune, meta_build, pretrain, setup

METHODS = {
    "full": {"name": "full"}, "lora": {"name": "lora", "rank": 4},
    "lowrank": {"name": "lowrank", "rank": 8}, "galore": {"name": "galore", "rank": 8},
    "relora": {"name": "relora", "rank": 4, "reset_every": 2, "restart_warmup_steps": 1},
    "apollo": {"name": "apollo", "rank": 8}, "fira": {"name": "fira", "rank": 8},
    "muon": {"name": "muon"}, "adam_mini": {"name": "adam_mini"},
    "adam8bit": {"name": "adam8bit"}, "apollo_mini": {"name": "apollo_mini"},
    "relora_lora_init": {"name": "relora", "rank": 4, "init": "lora"},
}


def seeded(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


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


def qwen2(folder: Path, family: str = "qwen2") -> str:
    """A tiny config (no weights) of `family`; Qwen2's head tied to its embedding."""
    from transformers import MistralConfig, Qwen2Config

    kind = Qwen2Config if family == "qwen2" else MistralConfig
    kind(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=8192,
         tie_word_embeddings=family == "qwen2").save_pretrained(folder / family)
    return str(folder / family)


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


def with_weights(folder: Path, family: str) -> str:
    """`qwen2`'s config with weights drawn by another seed, as save_pretrained writes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(qwen2(folder, family))
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / f"{family}_weights")
    return str(folder / f"{family}_weights")


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


def glue(model: str, **train: Any) -> dict[str, Any]:
    """A GLUE run (the embedded task: two labels) fine-tuning `model`."""
    return {**micro_run(**train), "model": model,
            "task": {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48}}


def encoder_folder(folder: Path, family: str) -> str:
    """A pretrained body as transformers saves one, drawn by another seed, with the sample
    tokenizer: a RoBERTa encoder (its files' keys without the `roberta.` prefix the classifier
    adds), or a LLaMA causal LM (its lm_head a weight the classifier does not take)."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        RobertaConfig,
        RobertaModel,
    )

    tok = AutoTokenizer.from_pretrained(str(SAMPLE / "tokenizer"))
    sizes = {"vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "pad_token_id": tok.pad_token_id}
    torch.manual_seed(5)
    if family == "roberta":
        body = RobertaModel(RobertaConfig(intermediate_size=128, max_position_embeddings=80,
                                          **sizes))
    else:
        body = LlamaForCausalLM(LlamaConfig(intermediate_size=160, **sizes))
    body.save_pretrained(folder / family)
    tok.save_pretrained(folder / family)
    return str(folder / family)


def rows_of(cpu: torch.nn.Module, rows: dict[str, torch.Tensor], rank: int, world: int) -> list:
    """The names whose rows (a parameter's [r·c, r·c + c)) or whole buffer differ from `cpu`'s."""
    differ = [n for n, b in cpu.named_buffers() if not torch.equal(rows[n], b)]
    for name, p in cpu.named_parameters():
        c = -(-p.shape[0] // world)
        if not torch.equal(rows[name], p.detach()[rank * c:rank * c + c]):
            differ.append(name)
    return differ


def each_rank(run: Any, world: int = 3) -> None:
    """The ordinary whole build (the trial's task's, seeded), and rank by rank of `world` the
    meta build: bitwise its rows, every name, the generator where the whole build leaves it."""
    build = partial((finetune if run.task.kind == "glue" else pretrain).build, run)
    seeded(run.seed)
    cpu = build()[0]
    generator = torch.get_rng_state()
    for rank in range(world):
        seeded(run.seed)
        twins = Twins(rank, world)
        model = meta_build.build(run, twins, build)[0]
        assert all(p.is_meta for p in model.parameters())
        assert model.training == cpu.training  # from_pretrained leaves it in eval mode
        rows = twins.values(model)
        assert rows.keys() == dict(cpu.named_parameters()).keys() | dict(cpu.named_buffers()).keys()
        assert rows_of(cpu, rows, rank, world) == [], rank
        assert torch.equal(torch.get_rng_state(), generator), rank


@pytest.mark.parametrize("family", ["preset", "llama", "roberta"])
def test_a_glue_classifier_builds_on_meta_as_its_rows_of_the_whole_build(tmp_path, family):
    """Fine-tuning: a preset's classifier drawn from the seed; a pretrained body read by rows
    from its folder and a new head drawn as from_pretrained draws it (LLaMA's `score`,
    RoBERTa's two-layer head with biases), three ranks, the head's 2 rows split unevenly."""
    model = "llama_micro" if family == "preset" else encoder_folder(tmp_path, family)
    each_rank(load_run(glue(model)))


def hub_repo(cache: Path, repo: str, source: Path) -> None:
    """`source`'s files as the hub's cache lays out a downloaded snapshot of `repo`."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    shutil.copytree(source, folder / "snapshots" / ("0" * 40))


def as_bin(folder: Path, shards: int, form: str = "bin") -> Path:
    """`folder`'s safetensors weights rewritten as PyTorch pickles (pytorch_model.bin), or as
    `shards` files of `form` (bin, safetensors) and the index that names each weight's."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    stem = "pytorch_model" if form == "bin" else "model"
    names, where = sorted(state), {}
    for k in range(shards):
        file = f"{stem}-{k + 1:05d}-of-{shards:05d}.{form}"
        part = {n: state[n] for n in names[k::shards]}
        if form == "bin":
            torch.save(part, folder / file)
        else:
            save_file(part, folder / file, metadata={"format": "pt"})
        where |= dict.fromkeys(part, file)
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": where}
    (folder / f"{stem}.{form}.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of the test's own (HF_HUB_OFFLINE is set for every test)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_a_hub_models_weights_are_read_by_rows_from_the_local_cache(hub_cache, tmp_path, form):
    """Continued pretraining and fine-tuning of a hub name: its snapshot found in the cache
    offline, read by rows (model.safetensors, or pytorch_model.bin memory-mapped)."""
    repo = f"someone/qwen2-{form}"
    source = Path(with_weights(tmp_path, "qwen2"))
    hub_repo(hub_cache, repo, as_bin(source, 1) if form == "bin" else source)
    each_rank(load_run({**micro_run(), "model": repo, "method": METHODS["lora"]}))
    llama = Path(encoder_folder(tmp_path, "llama"))
    hub_repo(hub_cache, f"{repo}-body", as_bin(llama, 1) if form == "bin" else llama)
    each_rank(load_run(glue(f"{repo}-body")))


def test_a_hub_model_whose_weights_are_not_cached_is_built_whole(hub_cache, tmp_path):
    """Its config cached, its weights not: the ordinary build (which downloads them) instead."""
    source = Path(with_weights(tmp_path, "mistral"))
    (source / "model.safetensors").unlink()
    hub_repo(hub_cache, "someone/uncached-weights", source)
    run = load_run({**micro_run(), "model": "someone/uncached-weights"})
    with pytest.raises(Unsupported, match=r"the weights of 'someone/uncached-weights' are not"):
        meta_build.build(run, Twins(0, 2), partial(pretrain.build, run))


@pytest.mark.parametrize(("task", "form"), [("pretrain", "bin"), ("glue", "bin"),
                                             ("pretrain", "safetensors")])
def test_sharded_weights_are_read_by_rows_through_their_index(tmp_path, task, form):
    """Weights in two shards named by their index json: .bin, as older checkpoints are, or
    safetensors, as save_pretrained shards a large model."""
    if task == "glue":
        run = load_run(glue(str(as_bin(Path(encoder_folder(tmp_path, "roberta")), 2, form))))
    else:
        folder = as_bin(Path(with_weights(tmp_path, "mistral")), 2, form)
        run = load_run({**micro_run(), "model": str(folder)})
    assert len(list(Path(run.model).glob(f"*.{form}"))) == 2
    each_rank(run)


def test_a_trial_without_a_final_model_is_the_one_source_built_whole(tmp_path):
    """model.from of a trial whose checkpoint must first be exported by its method (adapters
    merged, ...) on the host: the meta build is not tried, and says why."""
    with pytest.raises(Unsupported, match=r"has no final model; its checkpoint is exported"):
        classifier.from_trial(tmp_path, 2, load=lambda name, config: torch.nn.Module())


class Read(torch.Tensor):
    """A memory-mapped tensor of a .bin file that notes what is taken out of it."""

    taken: ClassVar[list[tuple[str, int]]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and func is not torch.Tensor.__getitem__:
            cls.taken.append((getattr(func, "__name__", str(func)), -1))  # read otherwise
        elif isinstance(out, torch.Tensor):
            cls.taken.append(("rows", out.numel() * out.element_size()))
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


def spy_on_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every read of a weight file's tensors, noted: safetensors' slices as `get_slice` gives
    them, and the tensors `torch.load` maps (asserted memory-mapped)."""
    import safetensors

    Read.taken = taken = []
    opened, loaded = safetensors.safe_open, torch.load

    class Slice:
        def __init__(self, inner: Any) -> None:
            self.inner, self.get_shape, self.get_dtype = inner, inner.get_shape, inner.get_dtype

        def __getitem__(self, index: Any) -> torch.Tensor:
            out = self.inner[index]
            taken.append(("rows", out.numel() * out.element_size()))
            return out

    class Handle:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = opened(*args, **kwargs)
            self.keys = self.inner.keys

        def get_slice(self, name: str) -> Slice:
            return Slice(self.inner.get_slice(name))

        def get_tensor(self, name: str) -> torch.Tensor:
            taken.append(("whole", -1))
            return self.inner.get_tensor(name)

    def load(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("mmap") is True
        return {k: v.as_subclass(Read) for k, v in loaded(*args, **kwargs).items()}

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    monkeypatch.setattr(torch, "load", load)
    return taken


@pytest.mark.parametrize("form", ["safetensors", "bin"])
def test_a_rank_reads_only_its_rows_of_each_weight(tmp_path, monkeypatch, form):
    """Rank 1 of 3 takes out of the files only slices, and as many bytes as its rows of each
    body weight (float32): [c, 2c) of m rows, c = ceil(m / 3); none of the new head."""
    folder = Path(encoder_folder(tmp_path, "roberta"))
    run = load_run(glue(str(as_bin(folder, 2) if form == "bin" else folder)))
    seeded(run.seed)
    cpu = finetune.build(run)[0]
    mine = 0
    for p in cpu.roberta.parameters():
        m, c = p.shape[0], -(-p.shape[0] // 3)
        mine += (min(2 * c, m) - min(c, m)) * p[0].numel() * 4
    taken = spy_on_reads(monkeypatch)
    seeded(run.seed)
    meta_build.build(run, Twins(1, 3), partial(finetune.build, run))
    assert all(kind == "rows" for kind, _ in taken), taken
    assert sum(size for _, size in taken) == mine


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
