"""GLUE fine-tuning end to end: the embedded task trains and beats chance, a pretraining
checkpoint becomes a classifier with its body intact, an encoder loads from a local folder,
and a stopped fine-tuning resumes to the same losses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, micro_run, train_losses

from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.train import train
from harness.train.classifier import from_trial, resolve_trial
from harness.trials import RunsDir


def glue_run(**train_keys) -> dict:
    data = micro_run(lr=0.003, batch_size=32, total_batch_size=32, log_every=10, **train_keys)
    data["train"].pop("steps")
    data["train"].setdefault("epochs", 1)
    data["task"] = {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48}
    data["eval"] = {"batch_size": 100}
    return data


def test_embedded_task_trains_and_beats_chance(tmp_path):
    summary = train(load_run(glue_run(epochs=2)), tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert summary["steps"] == 2 * (2000 // 32)  # epochs become steps
    assert summary["eval_accuracy"] > 70 and summary["best_eval_score"] >= summary["eval_score"]
    assert summary["best_epoch"] in (1.0, 2.0) and summary["eval_loss"] < 0.69  # ln 2: chance


def test_steps_and_epochs_are_one_budget():
    with pytest.raises(UserError, match=r"set train\.steps or train\.epochs, not both"):
        load_run({**glue_run(), "train": {**glue_run()["train"], "steps": 10}})
    assert load_run(micro_run()).train.steps == 6
    assert load_run({"method": {"name": "full"}}).train.steps == 100
    with pytest.raises(UserError, match="task: dataset: 'sample' holds only the embedded task"):
        load_run({**glue_run(), "task": {"kind": "glue", "glue_task": "cola"}})


def test_stopped_fine_tuning_resumes_to_the_same_losses(tmp_path):
    data = glue_run()
    data["train"]["log_every"] = 1
    train(load_run(data), tmp_path / "whole")
    stopped = train(load_run(data), tmp_path / "part", should_stop=lambda step: step == 25)
    assert stopped["status"] == "interrupted"
    resumed = train(load_run(data), tmp_path / "part")
    assert resumed["status"] == "ok"
    assert train_losses(tmp_path / "part") == train_losses(tmp_path / "whole")


@pytest.mark.parametrize("source", ["final model", "checkpoint"])
@pytest.mark.parametrize("method", [{"name": "full"}, {"name": "lora", "rank": 4}])
def test_trained_body_loads_into_the_classifier(tmp_path, method, source):
    """The classifier's body is the trained LLaMA's (LoRA: W + s·B·A), its head is new: from
    the trial's final model, or, where it has none, from its checkpoint exported."""
    run = load_run({**micro_run(steps=2, keep_final="full"), "method": method, "name": "pre"})
    assert train(run, tmp_path / "pre")["status"] == "ok"
    state = torch.load(tmp_path / "pre" / "checkpoint" / "state.pt", weights_only=False)["model"]
    if source == "checkpoint":
        shutil.rmtree(tmp_path / "pre" / "model")
    model, _ = from_trial(tmp_path / "pre", num_labels=3)
    body = model.state_dict()
    assert model.score.weight.shape == (3, 64)
    if method["name"] == "full":
        loaded = {k: v for k, v in state.items() if k.startswith("model.")}
        assert loaded.keys() == {k for k in body if k != "score.weight"}
        assert all(torch.equal(body[k], v) for k, v in loaded.items())
    else:
        prefix = "base_model.model.model.layers.0.self_attn.q_proj."
        base = state[prefix + "base_layer.weight"]
        a, b = state[prefix + "lora_A.default.weight"], state[prefix + "lora_B.default.weight"]
        expected = base + (method.get("alpha", 16.0) / 4) * b @ a
        assert not torch.equal(b, torch.zeros_like(b))  # the adapter trained
        assert torch.allclose(body["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)


def test_sweep_dir_resolves_to_its_best_trial(tmp_path):
    for lr in (0.003, 0.0001):
        run = load_run({**micro_run(steps=2, lr=lr), "name": "pre"})
        train(run, tmp_path / "runs" / "trials" / f"full-{lr}")
    best = resolve_trial(str(tmp_path / "runs"))
    assert best.name == "full-0.003"
    with pytest.raises(UserError, match="neither a trial folder"):
        resolve_trial(str(tmp_path / "nowhere"))


def test_a_sweeps_unreadable_trial_is_named_not_passed_over(tmp_path, capsys):
    """model.from picks the best trial by its summary: one that cannot be read may have been
    the best, so the pick says it left it out (summaries written by hand: nothing trains)."""
    runs = RunsDir(tmp_path / "runs")
    runs.trial("full-a").write_summary({"trial": "full-a", "status": "ok", "method": "full",
                                        "eval_ppl": 30.0})
    damaged = runs.trial("full-b")
    damaged.summary.parent.mkdir()
    damaged.summary.write_text('{"trial": "full-b", "status": "ok", "eval_ppl": 2')
    assert resolve_trial(str(tmp_path / "runs")).name == "full-a"
    out = capsys.readouterr().out
    assert f"model.from: full-b left out: {damaged.summary}: not JSON" in out
    assert "best trial is full-a" in out


def bert_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A BERT-family encoder as transformers saves one (config.json, model.safetensors, its
    own tokenizer: the sample corpus's), built here, small: 2 layers of width 64. Its
    weights, to check that loading keeps them."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(str(REPO / "harness" / "data" / "sample" / "tokenizer"))
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=tok.pad_token_id))
    encoder.save_pretrained(folder)
    tok.save_pretrained(folder)
    return encoder.state_dict()


def test_encoder_from_a_local_folder_fine_tunes(tmp_path):
    """A BERT encoder from a folder (AutoModelForSequenceClassification): its weights load as
    saved, its own tokenizer with them, under a new head; fine-tuned one epoch it beats chance
    (50%) by far."""
    from harness.train.classifier import pretrained

    saved = bert_folder(tmp_path / "bert")
    model, tok = pretrained(str(tmp_path / "bert"), num_labels=2, dropout=0.1)
    body = model.bert.state_dict()
    assert saved.keys() <= body.keys() and all(torch.equal(body[k], v) for k, v in saved.items())
    assert model.classifier.weight.shape == (2, 64) and model.config.classifier_dropout == 0.1
    assert len(tok) == 8192
    data = glue_run(warmup_steps=3)  # one epoch at 0.003: 62 steps of 32
    data["model"] = str(tmp_path / "bert")
    data["task"]["classifier_dropout"] = 0.1
    summary = train(load_run(data), tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert summary["eval_accuracy"] > 75


FINE_TUNED = [
    {"name": "adam8bit"}, {"name": "qlora", "rank": 4}, {"name": "galore", "rank": 8},
    {"name": "qgalore", "rank": 8}, {"name": "lowrank", "rank": 16},
    {"name": "relora", "rank": 4, "reset_every": 20, "restart_warmup_steps": 5},
]  # fmt: skip
# The quick tier keeps the methods that change the classifier's model (NF4 base and adapters,
# INT8 weights, factors, merges); 8-bit Adam and GaLore, optimizers only, run in the
# integration tier (tests/tiers.py).
QUICK = {"test_every_method_fine_tunes_the_embedded_task": [
    (method,) for method in FINE_TUNED if method["name"] not in ("adam8bit", "galore")]}


@pytest.mark.parametrize("method", FINE_TUNED)
def test_every_method_fine_tunes_the_embedded_task(tmp_path, method):
    data = {**glue_run(), "method": method}
    summary = train(load_run(data), tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert summary["eval_accuracy"] > 55, summary  # chance is 50


def test_one_command_pretrains_then_fine_tunes_and_reports(tmp_path):
    """`model: {from: DIR, sweep: FILE}`: the sweep runs FILE into DIR first, then fine-tunes
    its best trial; the report is the Table 4 layout."""
    from conftest import harness_here, write_yaml

    pre = {**micro_run(steps=2), "methods": {"full": {}}, "name": "pre"}
    pre.pop("method")
    write_yaml(tmp_path / "pre.yaml", pre)
    glue = {**glue_run(), "name": "ft", "methods": {"full": {}},
            "model": {"from": str(tmp_path / "runs_pre"), "sweep": str(tmp_path / "pre.yaml")},
            "search": {"metric": "eval_score", "direction": "maximize"}}
    glue.pop("method")
    write_yaml(tmp_path / "ft.yaml", glue)
    done = harness_here("sweep", str(tmp_path / "ft.yaml"), "--out", str(tmp_path / "runs_ft"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs_pre does not exist yet; running" in done.stdout
    config = (next((tmp_path / "runs_ft" / "trials").iterdir()) / "config.yaml").read_text()
    assert "  from: " in config and "from_" not in config
    report = harness_here("report", str(tmp_path / "runs_ft"))
    assert report.returncode == 0, report.stderr
    assert "| method   | Sample   | avg   | memory   | tok/s   |" in report.stdout
