"""What a finished trial leaves (issue 30): its model in Hugging Face format, which
transformers loads and which gives the trial's own final eval loss; its training state gone
unless `keep_final: full`; and it is never trained again for want of that state."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
from conftest import harness, hf_eval_loss, micro_run
from method_matrix import METHODS, MODEL_METHODS

from harness.errors import UserError
from harness.methods.base import Method, get_method
from harness.methods.resolve import load_run
from harness.train import train
from harness.train.export import export_trial

# Every method whose model is its own (tests/method_matrix.py's MODEL_METHODS: a `prepare`, so
# an `export`, of its own; full among them) with its settings for llama_micro, plus the forms
# whose model differs: INT8 weights (APOLLO's 7B recipe), Q-GaLore's simulated INT8 (a
# parametrization), ReLoRA after a merge. A method that keeps the model as built exports it as
# it is (Method.export), which is full's export: its optimizer changes no step of it.
EXPORTS = {**{m: s for m, s in METHODS.items()
              if m in MODEL_METHODS or get_method(m).export is not Method.export},
           "apollo_int8": {"name": "apollo", "rank": 8, "update_proj_gap": 2,
                           "int8_weights": True},
           "qgalore_simulate": {"name": "qgalore", "rank": 8, "update_proj_gap": 2,
                                "simulate": True}}
# Each kind of export stays in the quick tier; the rest run in the integration tier
# (tests/tiers.py).
QUICK = {"test_each_methods_final_model_loads_in_transformers_with_the_trials_eval_loss": {
    (label,) for label in ("full", "lora", "qlora", "lowrank", "qgalore", "qgalore_simulate",
                           "apollo_int8")}}


def finished(tmp_path, method: dict, **train_keys) -> tuple[dict, object]:
    data = micro_run(steps=3, **train_keys)
    data["method"] = method
    return train(load_run(data), tmp_path / "trial"), tmp_path / "trial"


def model_never_written(trial) -> None:
    """The trial as a kill between its `ok` summary and its final model leaves it (and as
    earlier versions wrote every trial): its final checkpoint, no model, no `keep_final`."""
    shutil.rmtree(trial / "model")
    (trial / "model.json").unlink()
    on_disk = json.loads((trial / "summary.json").read_text())
    del on_disk["keep_final"], on_disk["final_model_bytes"]
    (trial / "summary.json").write_text(json.dumps(on_disk))


@pytest.mark.parametrize("label", list(EXPORTS))
def test_each_methods_final_model_loads_in_transformers_with_the_trials_eval_loss(tmp_path,
                                                                                  label):
    summary, trial = finished(tmp_path, EXPORTS[label])
    assert summary["status"] == "ok" and summary["keep_final"] == "weights"
    data = micro_run()
    # 1e-5 relative, the bound: merged, dequantized or multiplied-out weights differ
    # from the trained form's products by float32 rounding (measured: at most 8.6e-8 relative
    # over every method's form, 0 for several)
    assert hf_eval_loss(trial / "model", data["task"], data["eval"]["tokens"]) == pytest.approx(
        summary["eval_loss"], rel=1e-5)
    assert not (trial / "checkpoint").exists()
    assert summary["final_model_bytes"] == sum(
        p.stat().st_size for p in (trial / "model").iterdir())


def test_the_quickstarts_trial_keeps_a_model_a_fraction_of_its_training_state(tmp_path):
    full, trial = finished(tmp_path / "full", {"name": "full"}, keep_final="full")
    state = sum(p.stat().st_size for p in (trial / "checkpoint").glob("state*.pt"))
    model = full["final_model_bytes"]
    # AdamW's state is weights + two moments + the rest: a model alone is about a third
    assert model < 0.4 * state and (trial / "model").is_dir()


def test_keep_final_none_keeps_neither_and_the_trial_stays_finished(tmp_path):
    summary, trial = finished(tmp_path, {"name": "full"}, keep_final="none")
    assert summary["keep_final"] == "none" and "final_model_bytes" not in summary
    assert not (trial / "model").exists() and not (trial / "checkpoint").exists()
    on_disk = json.loads((trial / "summary.json").read_text())
    again = train(load_run({**micro_run(steps=3, keep_final="none")}), trial)
    assert again == on_disk  # not trained again: nothing to resume from, and nothing to do


def test_a_finished_trial_is_not_retrained_once_its_state_is_gone(tmp_path, capsys):
    _, trial = finished(tmp_path, {"name": "full"})
    metrics, on_disk = (trial / "metrics.jsonl").read_text(), (trial / "summary.json").read_text()
    again = train(load_run(micro_run(steps=3)), trial)
    assert again == json.loads(on_disk) and (trial / "metrics.jsonl").read_text() == metrics
    assert (trial / "summary.json").read_text() == on_disk
    assert "already finished" in capsys.readouterr().out


def test_a_kill_before_the_model_was_written_finishes_from_the_final_checkpoint(tmp_path):
    """A trial whose summary says ok but whose finish never ran (killed between the two, or
    written before final models existed) is exported from its final checkpoint, not retrained."""
    summary, trial = finished(tmp_path, {"name": "full"}, keep_final="full")
    model_never_written(trial)
    metrics = (trial / "metrics.jsonl").read_text()
    again = train(load_run(micro_run(steps=3)), trial)
    assert (trial / "metrics.jsonl").read_text() == metrics  # no step ran again
    assert again["final_model_bytes"] == summary["final_model_bytes"]
    assert not (trial / "checkpoint").exists()


def test_a_damaged_final_model_with_no_state_left_trains_again(tmp_path):
    summary, trial = finished(tmp_path, {"name": "full"})
    weights = trial / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # torn
    again = train(load_run(micro_run(steps=3)), trial)
    assert again["status"] == "ok" and again["eval_loss"] == summary["eval_loss"]
    assert math.isfinite(again["final_model_bytes"])


@pytest.mark.parametrize("label", ["lora", "lowrank"])
def test_harness_export_writes_an_interrupted_trials_newest_checkpoint(tmp_path, label):
    """`harness export` of a trial stopped at step 2 of 6: the model it held at step 2,
    whose loss transformers reproduces against a straight run's step-2 evaluation."""
    data = micro_run(steps=6, checkpoint_every=2)
    data["method"] = EXPORTS[label]
    data["eval"]["every"] = 2
    run = load_run(data)
    train(run, tmp_path / "trial", should_stop=lambda step: step == 2)
    straight = train(load_run({**data, "train": {**data["train"], "steps": 2}}),
                     tmp_path / "two")
    export_trial(tmp_path / "trial", tmp_path / "out")
    assert hf_eval_loss(tmp_path / "out", data["task"], data["eval"]["tokens"]) == pytest.approx(
        straight["eval_loss"], rel=1e-5)


def test_harness_export_copies_a_finished_trials_model(tmp_path):
    _, trial = finished(tmp_path, {"name": "full"})
    done = harness("export", str(trial), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        trial / "model" / "model.safetensors").read_bytes()


def test_harness_export_of_a_folder_that_is_no_trial_is_one_line(tmp_path):
    done = harness("export", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "not a trial folder" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_export_never_writes_over_a_folder_with_files(tmp_path):
    _, trial = finished(tmp_path, {"name": "full"})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not an empty folder"):
        export_trial(trial, tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_a_final_model_continues_pretraining_and_fine_tunes_as_any_hf_folder(tmp_path):
    """`model:` names the folder: a pretraining run builds the saved weights and trains on from
    them, and a GLUE run puts a new head on that body."""
    from safetensors.torch import load_file

    from harness.train import pretrain
    from harness.train.classifier import build_classifier

    _, trial = finished(tmp_path, {"name": "lora", "rank": 4})
    folder = str(trial / "model")
    again = load_run({**micro_run(steps=2), "model": folder})
    model, _ = pretrain.build(again)
    saved = load_file(trial / "model" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert train(again, tmp_path / "continued")["status"] == "ok"
    glue = load_run({**micro_run(), "model": folder,
                     "task": {"kind": "glue", "glue_task": "sample", "tokenizer": "sample",
                              "seq_len": 48},
                     "train": {"epochs": 1, "batch_size": 32, "total_batch_size": 32}})
    classifier, _ = build_classifier(glue, 2)
    body = classifier.state_dict()
    assert classifier.score.weight.shape == (2, 64)
    assert all(torch.equal(body[k], v) for k, v in saved.items() if k.startswith("model."))


def test_a_full_disk_while_the_model_is_written_keeps_the_checkpoint(small_disk, capsys):
    """A real tmpfs with 1 MB left when the final model (4.6 MB) is written: one line on
    stderr, the trial `ok` with its final checkpoint whole; with room again, the next run
    writes the model from it without training a step."""
    summary, trial = finished(small_disk, {"name": "full"}, keep_final="full")
    model_never_written(trial)
    state = (trial / "checkpoint" / "state.pt").read_bytes()
    stat = os.statvfs(small_disk)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize - (1 << 20))
    capsys.readouterr()
    again = train(load_run(micro_run(steps=3)), trial)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: final model {trial / 'model'} not written: ")
    assert "No space left on device" in line and line.endswith("writes the model from it)")
    assert again["status"] == "ok" and "keep_final" not in again
    assert (trial / "checkpoint" / "state.pt").read_bytes() == state
    assert not (trial / "model").exists() and not list(trial.glob(".model.tmp*"))
    filler.unlink()
    done = train(load_run(micro_run(steps=3)), trial)
    assert done["final_model_bytes"] == summary["final_model_bytes"]
    assert not (trial / "checkpoint").exists()


def end_of_document_id(folder) -> int:
    """The id of '</s>', the token the sample tokenizer names EOS, read from tokenizer.json
    (the sample's is 1; 2 is '<unk>')."""
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == "</s>")


def test_an_export_generates_until_the_end_of_document_token_training_inserts(tmp_path):
    """`generate()` stops at the EOS id the packer put between documents: a logits script
    makes the loaded model emit one word 3 times, then '</s>', then the word again; generation
    stops after prompt + 4 tokens, not at max_new_tokens (12). AutoTokenizer loads the export
    folder and names the same EOS; the config keeps the KV cache on for generation."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
    )

    _, trial = finished(tmp_path, {"name": "full"})
    export_trial(trial, tmp_path / "out")
    eos = end_of_document_id(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert tok.eos_token_id == eos == 1
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    assert model.config.use_cache is True and model.generation_config.use_cache is True
    prompt = tok("The weather", return_tensors="pt").input_ids
    word = tok.convert_tokens_to_ids(tok.tokenize(" day"))[0]

    class Script(LogitsProcessor):
        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - prompt.shape[1]
            forced = torch.full_like(scores, -1e9)
            forced[:, eos if made == 3 else word] = 0.0
            return forced

    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False,
                             logits_processor=LogitsProcessorList([Script()]))
    assert out[0, prompt.shape[1]:].tolist() == [word, word, word, eos]


def test_an_earlier_versions_final_model_exports_with_the_tokenizers_ids(tmp_path):
    """A final model written before its configs took the tokenizer's ids (LLaMA's defaults:
    EOS 2, the KV cache off), with its record: its export gets EOS 1 and the cache on, and
    keeps every other key."""
    import hashlib

    _, trial = finished(tmp_path, {"name": "full"})
    record = json.loads((trial / "model.json").read_text())
    for name in ("config.json", "generation_config.json"):
        path = trial / "model" / name
        text = path.read_text().replace('"eos_token_id": 1', '"eos_token_id": 2')
        path.write_text(text.replace('"use_cache": true', '"use_cache": false'))
        record["files"][name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                 "bytes": path.stat().st_size}
    (trial / "model.json").write_text(json.dumps(record))
    export_trial(trial, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (config["eos_token_id"], generation["eos_token_id"]) == (1, 1)
    assert config["use_cache"] is True and generation["use_cache"] is True
    assert generation["pad_token_id"] == config["pad_token_id"] == 0
    assert config["hidden_size"] == 64 and config["vocab_size"] == 8192


def test_a_final_model_and_its_export_have_the_modes_of_every_other_file(tmp_path):
    """Under umask 022 every file of the trial's model folder and of its export is 0644
    (model.safetensors came out 0600 from its temporary file)."""
    old = os.umask(0o022)
    try:
        _, trial = finished(tmp_path, {"name": "full"})
        export_trial(trial, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {f"{p.parent.name}/{p.name}": oct(p.stat().st_mode & 0o777)
             for folder in (trial / "model", tmp_path / "out") for p in folder.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_export_help_names_a_trial_folder_the_quickstart_writes(capsys):
    from harness.cli import main
    from harness.sweep.plan.expand import expand, load_sweep

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    named = re.search(r"runs/quickstart/trials/([\w-]+)", capsys.readouterr().out)
    assert named, "no example trial folder"
    assert named.group(1) in {t.id for t in expand(load_sweep("sweeps/quickstart.yaml", {}))}
