"""Hub names where the hub cannot be reached (issue 65): a tokenizer, model or dataset that is
not in the local Hugging Face cache fails at once in one line naming the offline cause and the
local alternative, instead of after tens of seconds of retries; one that is cached loads from
the cache alone. The hub is made unreachable for certain: its endpoint is a closed local port
(connection refused at once), with HF_HUB_OFFLINE unset as on a machine whose network is down."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from huggingface_hub import constants

from harness.config import TaskConfig
from harness.config import hub as hub_module
from harness.data.c4 import SAMPLE, load_tokenizer, open_documents
from harness.data.glue import get_task, load_split
from harness.errors import UserError
from harness.models import architecture
from harness.train.classifier import pretrained

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there
QUICK_S = 5.0  # the retries it replaces took 27-52 s; loading from the cache takes ~0.1 s


@pytest.fixture
def unreachable(tmp_path, monkeypatch):
    """The hub unreachable with HF_HUB_OFFLINE unset, and an empty cache of our own."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_module.offline.cache_clear()
    yield tmp_path / "hub"
    hub_module.offline.cache_clear()


def cache_repo(cache, repo: str, files: dict[str, str]) -> None:
    """`files` as the hub's cache lays out a downloaded repository's snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)


def quick(call):
    """The UserError `call` raises, and that it came within QUICK_S."""
    start = time.monotonic()
    with pytest.raises(UserError) as raised:
        call()
    assert time.monotonic() - start < QUICK_S
    return str(raised.value)


def test_the_offline_cause_is_hf_hub_offline_or_the_failed_probe(unreachable, monkeypatch):
    assert hub_module.offline().startswith(f"offline: no connection to {CLOSED}: ")
    hub_module.offline.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_module.offline() == "offline: HF_HUB_OFFLINE is set"


def test_a_tokenizer_not_in_the_cache_fails_at_once_naming_the_cause(unreachable):
    message = quick(lambda: load_tokenizer("someone/absent-tokenizer"))
    assert message.startswith(
        "task.tokenizer: 'someone/absent-tokenizer' is not in the local Hugging Face cache and "
        f"the hub cannot be reached (offline: no connection to {CLOSED}: ")
    assert message.endswith("); set task.tokenizer to a folder holding tokenizer.json, or "
                            "'sample' (the embedded tokenizer)")


def test_a_cached_tokenizer_loads_from_the_cache_alone(unreachable):
    """The sample tokenizer's files cached under a hub name, with the config.json a hub
    repository has (AutoTokenizer reads it first): its EOS, '</s>', is id 1."""
    files = {p.name: p.read_text() for p in (SAMPLE / "tokenizer").iterdir()}
    files["config.json"] = json.dumps({"model_type": "llama"})
    cache_repo(unreachable, "someone/cached-tokenizer", files)
    start = time.monotonic()
    tok = load_tokenizer("someone/cached-tokenizer")
    assert time.monotonic() - start < QUICK_S
    assert tok.eos_token_id == 1 and len(tok) == 8192


def test_a_model_not_in_the_cache_fails_at_once_and_a_cached_one_loads(unreachable):
    message = quick(lambda: architecture("someone/absent-model"))
    assert message.startswith("model: unknown model preset 'someone/absent-model'")
    assert ("; 'someone/absent-model' is not in the local Hugging Face cache and the hub "
            f"cannot be reached (offline: no connection to {CLOSED}") in message
    assert message.endswith("; a local model is a folder holding config.json or a config.json "
                            "file")
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 8192}
    cache_repo(unreachable, "someone/cached-model", {"config.json": json.dumps(config)})
    start = time.monotonic()
    arch = architecture("someone/cached-model")
    assert time.monotonic() - start < QUICK_S
    assert (arch.hidden, arch.layers, arch.vocab) == (64, 2, 8192)


def test_c4_from_the_hub_fails_at_once_naming_local_c4_and_the_sample(unreachable):
    message = quick(lambda: open_documents(TaskConfig(dataset="c4"), "train"))
    assert message.startswith("task.dataset: 'c4' streams allenai/c4 from the Hugging Face hub, "
                              f"which cannot be reached (offline: no connection to {CLOSED}")
    assert message.endswith("for local C4 set task.dataset to the folder of c4-train.*.json.gz "
                            "shards, or use 'sample' (the embedded corpus)")


def test_a_glue_task_not_in_the_datasets_cache_fails_at_once(unreachable, monkeypatch):
    from datasets import config

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", unreachable / "datasets")
    message = quick(lambda: load_split(get_task("cola"), "hub", "train"))
    assert message.startswith("task.dataset: 'nyu-mll/glue/cola' is not in the local Hugging "
                              "Face cache and the hub cannot be reached (offline: ")
    assert message.endswith("set task.dataset to a folder of GLUE-schema files, or glue_task: "
                            "sample (the embedded task)")


def test_a_local_folder_never_asks_the_hub(unreachable, tmp_path):
    """A tokenizer folder loads whatever the hub's state (no probe is needed for it)."""
    shutil.copytree(SAMPLE / "tokenizer", tmp_path / "tok")
    assert load_tokenizer(str(tmp_path / "tok")).eos_token_id == 1
    assert hub_module.offline.cache_info().misses == 0


def test_a_glue_encoder_not_in_the_cache_fails_at_once(unreachable):
    """A fine-tuning run's hub encoder (`model: someone/encoder`) goes the same way."""
    message = quick(lambda: pretrained("someone/absent-encoder", 2, None))
    assert message.startswith("model: 'someone/absent-encoder' is not in the local Hugging Face "
                              f"cache and the hub cannot be reached (offline: no connection to "
                              f"{CLOSED}")
    assert message.endswith("give a local model folder, a preset, or {from: runs/<sweep>}")
