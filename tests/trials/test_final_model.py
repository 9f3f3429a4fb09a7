"""harness/trials/final_model.py: a final model is in place only once every file is written
and every tensor reads back as the one saved; otherwise what was there stays."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from harness.trials import CheckpointError, final_model


def saver(tensors: dict[str, torch.Tensor]):
    def save(folder):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")
    return save


def test_a_model_that_reads_back_equal_is_put_in_place_with_its_record(tmp_path):
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    size = final_model.write(tmp_path / "model", saver(tensors), tensors, step=7)
    files = {p.name: p.stat().st_size for p in (tmp_path / "model").iterdir()}
    assert size == sum(files.values()) == final_model.verified(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.json"]


@pytest.mark.parametrize("fault", ["another value", "a tensor left out"])
def test_a_model_that_does_not_read_back_leaves_the_one_in_place(tmp_path, fault):
    kept = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    final_model.write(tmp_path / "model", saver(kept), kept, step=1)
    before = (tmp_path / "model" / "model.safetensors").read_bytes()
    meant = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    written = ({**meant, "w": torch.full((2, 3), 2.0)} if fault == "another value"
               else {"w": meant["w"]})
    with pytest.raises(CheckpointError, match=r"final model .* not written: "):
        final_model.write(tmp_path / "model", saver(written), meant, step=2)
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.json"]  # no temp


def test_a_tied_weight_saved_once_counts_for_both_names(tmp_path):
    embed = torch.randn(4, 2)
    tensors = {"embed.weight": embed, "head.weight": embed}  # one storage, two names
    final_model.write(tmp_path / "model", saver({"embed.weight": embed}), tensors, step=1)
    assert final_model.verified(tmp_path / "model") is not None


def test_a_file_whose_size_changed_is_not_a_verified_model(tmp_path):
    tensors = {"w": torch.ones(8)}
    final_model.write(tmp_path / "model", saver(tensors), tensors, step=1)
    with open(tmp_path / "model" / "config.json", "a") as f:
        f.write(" ")
    assert final_model.verified(tmp_path / "model") is None


@pytest.mark.parametrize("shard", [None, "4KB"], ids=["one-file", "hf-sharded"])
def test_a_streamed_tied_model_writes_the_whole_saves_files_and_verifies(tmp_path, shard):
    """A tied LLaMA (the head is the embedding) streamed from its skeleton: the files
    save_pretrained writes of the model with its weights, byte for byte (the tied weight once;
    past max_shard_size, the same shards and index), and the read-back check passes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.trials import stream_export

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    whole = LlamaForCausalLM(config)
    kw = {"max_shard_size": shard} if shard else {}
    whole.save_pretrained(tmp_path / "whole", **kw)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    weights = whole.state_dict()
    params = dict(skeleton.named_parameters(remove_duplicate=False))

    def read(name, like):
        return weights[name].clone()

    def save(folder):
        with stream_export.streaming(read):
            skeleton.save_pretrained(folder, **kw)

    lazy = stream_export.Lazy(skeleton.state_dict(), read, lambda n: id(params.get(n, n)))
    final_model.write(tmp_path / "streamed", save, lazy, step=1)
    want = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    got = {p.name: p.read_bytes() for p in (tmp_path / "streamed").iterdir()}
    assert got.keys() == want.keys() and (len(want) > 3) == bool(shard)
    assert [n for n in want if got[n] != want[n]] == []
    assert "lm_head.weight" in lazy and not any(b"lm_head" in b for b in want.values())


class _Listed:
    """A folder's entries, listed before the race, handed out as os.scandir's iterator is."""

    def __init__(self, entries: list[os.DirEntry]) -> None:
        self.entries = iter(entries)

    def __enter__(self) -> _Listed:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __iter__(self) -> _Listed:
        return self

    def __next__(self) -> os.DirEntry:
        return next(self.entries)


@pytest.mark.parametrize("gone", ["a file", "the folder"])
def test_a_model_another_worker_drops_at_the_same_time_is_dropped_without_error(
        tmp_path, monkeypatch, gone):
    """Two workers of one sweep may drop the same model (a Postgres study's eight workers did):
    the other removes a file after this one listed it, or the whole folder before this one
    lists it (replayed at this one's first listing). Neither is an error; what is gone counts
    as freed by the other."""
    tensors = {"w": torch.zeros(2, 3)}
    model = tmp_path / "model"
    final_model.write(model, saver(tensors), tensors, step=1)
    scandir, raced = os.scandir, []

    def listing(path):
        if raced:
            return scandir(path)
        raced.append(path)
        if gone == "the folder":
            shutil.rmtree(model)
            return scandir(path)  # the folder is gone now: FileNotFoundError
        listed = _Listed(list(scandir(path)))
        (model / "model.safetensors").unlink()
        return listed

    monkeypatch.setattr(os, "scandir", listing)
    freed = final_model.drop(model)
    assert [os.fspath(p) for p in raced] == [os.fspath(model)]
    assert freed == (len("{}") if gone == "a file" else 0)  # config.json, where it was left
    assert list(tmp_path.iterdir()) == []
