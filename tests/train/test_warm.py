"""harness/train/warm.py: the table it builds is the one a trial's export uses, so a process
that imported it (the fork server, inherited by every forked trial) never builds it again."""

from __future__ import annotations

import importlib

import pytest
from conftest import micro_model
from transformers import conversion_mapping

from harness.sweep.run.starter import PRELOAD


def test_an_export_after_the_warm_up_builds_no_conversion_table(tmp_path, monkeypatch):
    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)
    importlib.reload(importlib.import_module("harness.train.warm"))

    def built_again():
        raise AssertionError("save_pretrained built the conversion table again")

    monkeypatch.setattr(conversion_mapping, "_build_checkpoint_conversion_mapping", built_again)
    micro_model().save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").stat().st_size > 4_000_000  # 1.15M fp32 parameters


def test_without_the_warm_up_an_export_builds_it(tmp_path, monkeypatch):
    """The check above can fail: with an empty table the export does call the builder."""
    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)

    def builder():
        raise RuntimeError("built")

    monkeypatch.setattr(conversion_mapping, "_build_checkpoint_conversion_mapping", builder)
    with pytest.raises(RuntimeError, match="built"):
        micro_model().save_pretrained(tmp_path, safe_serialization=True)


def test_the_fork_server_loads_it():
    assert "harness.train.warm" in PRELOAD
