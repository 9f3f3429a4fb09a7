"""Meta-device construction of models with weights (harness/train/meta_build.py): a GLUE
classifier (its body read by rows, its new head drawn as from_pretrained draws it), a hub
model's cached snapshot, .bin files and shards named by an index; each rank bitwise its rows of
the ordinary whole build, the generator where that build leaves it, and only its rows read."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from conftest import micro_run
from huggingface_hub import constants
from meta_sources import as_bin, encoder_folder, glue, hub_repo, seeded, with_weights

from harness.distributed.materialize import Twins, Unsupported
from harness.methods.resolve import load_run
from harness.train import classifier, finetune, meta_build, pretrain


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
    each_rank(load_run({**micro_run(), "model": repo, "method": {"name": "lora", "rank": 4}}))
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
