"""The final model streamed (issue 68): its safetensors files are those the whole model's save
writes, byte for byte, and writing them holds about one tensor on the host, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, micro_run, write_yaml
from test_export import EXPORTS

from harness.errors import UserError
from harness.methods import Method, build_method
from harness.methods.resolve import load_run
from harness.modifiers.precision import pure_bf16
from harness.train import export, pretrain
from harness.train.plain import save_plain
from harness.trials import TrialDir, stream_export
from harness.trials.checksums import digest


def checkpoint_states(run, tmp_path: Path) -> dict[str, dict]:
    """A trained-looking model's weights as a one-process checkpoint holds them, and as a
    sharded one does (one process's torch.distributed.checkpoint of the same state dict)."""
    torch.manual_seed(0)
    model, _ = pretrain.build(run)
    weights = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    dcp.save(weights, checkpoint_id=tmp_path / "state.pt" / "model", no_dist=True)
    return {"one-process": {"model": weights, "step": 3},
            "sharded": {"sharded": tmp_path / "state.pt", "record": {}, "step": 3}}


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_streamed_export_writes_the_files_the_whole_models_save_writes(tmp_path, monkeypatch,
                                                                         precision):
    """Every file (safetensors, configs, tokenizer) equal byte for byte to today's export of
    the model built whole, from a one-process checkpoint and from a sharded one; bf16-true
    exports bf16. The streamed export builds no model with weights."""
    run = load_run(micro_run(precision=precision))
    states = checkpoint_states(run, tmp_path)
    save_plain(*export.generating(run, states["one-process"]), tmp_path / "whole", 3,
               record=False)  # as the export wrote every model before
    want = files(tmp_path / "whole")
    assert set(want) >= {"model.safetensors", "config.json", "tokenizer.json"}

    def no_whole_model(*_):
        raise AssertionError("the whole model was built")

    monkeypatch.setattr(export, "generating", no_whole_model)
    for label, state in states.items():
        size = export.write_model(run, state, tmp_path / label, 3, record=False)
        got = files(tmp_path / label)
        assert got.keys() == want.keys(), label
        assert [n for n in want if got[n] != want[n]] == [], label
        assert size == sum(len(b) for b in want.values())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "sharded" / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == ({"BF16"} if precision == "bf16-true" else {"F32"})


def test_a_sharded_checkpoint_whose_metadata_changed_is_refused_in_one_line(tmp_path):
    """Its `.metadata` is verified against the record before the layout is read from it:
    UserError naming the checkpoint, nothing written."""
    run = load_run(micro_run())
    state = checkpoint_states(run, tmp_path)["sharded"]
    meta = tmp_path / "state.pt" / "model" / ".metadata"
    state["record"] = {"files": {"model/.metadata": digest(meta)}}
    meta.write_bytes(meta.read_bytes()[:-1] + b"x")
    with pytest.raises(UserError, match=r"^checkpoint .*state\.pt: [^\n]*metadata[^\n]*$"):
        export.write_model(run, state, tmp_path / "out", 3, record=False)
    assert not (tmp_path / "out").exists()


# Every registered method with an export of its own but QLoRA (built whole: below), at
# llama_micro's sizes, and the forms whose model differs (tests/train/test_export.py's).
MERGED = {label: method for label, method in EXPORTS.items() if label != "qlora" and type(
    build_method(load_run({**micro_run(), "method": method}))).export is not Method.export}


def roberta_folder(folder: Path) -> str:
    """A RoBERTa encoder saved as transformers saves one, small (2 layers of width 64), with
    the sample tokenizer."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    tok = AutoTokenizer.from_pretrained(str(REPO / "harness" / "data" / "sample" / "tokenizer"))
    torch.manual_seed(1)
    RobertaModel(RobertaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=tok.pad_token_id),
        add_pooling_layer=False).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def glue(model: str | dict, method: dict, dropout: float | None = None) -> dict:
    data = {**micro_run(), "model": model, "method": method}
    data["task"] = {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48,
                    "classifier_dropout": dropout}
    return data


def trained_states(run, tmp_path: Path, sharded: bool = True) -> dict[str, dict]:
    """A trained-looking prepared model's state (every float tensor moved off its start: LoRA's
    B is no longer zero), as a one-process checkpoint holds it and (`sharded`) as a sharded
    one does."""
    torch.manual_seed(0)
    model, _ = export.builder(run)(run)
    model = pure_bf16(build_method(run).prepare(pure_bf16(model, run.train), run), run.train)
    moved: dict[int, torch.Tensor] = {}  # by storage: a tied weight moves once
    weights = {k: moved.setdefault(v.data_ptr(), v + 0.01 * torch.randn_like(v)
                                   if v.is_floating_point() else v.clone())
               for k, v in model.state_dict().items()}
    states = {"one-process": {"model": weights, "step": 3}}
    if sharded:
        dcp.save(weights, checkpoint_id=tmp_path / "state.pt" / "model", no_dist=True)
        states["sharded"] = {"sharded": tmp_path / "state.pt", "record": {}, "step": 3}
    return states


def tied_llama_folder(folder: Path) -> str:
    """A LLaMA whose head is its input embedding (as Qwen2's small models), saved with the
    sample tokenizer: 2 layers of width 64."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(REPO / "harness" / "data" / "sample" / "tokenizer"))
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def pretrained_trial(folder: Path) -> str:
    """A pretraining trial's folder as `model: {from: ...}` takes it: its config and a verified
    final model (llama_micro's)."""
    run = load_run(micro_run())
    write_yaml(folder / "config.yaml", micro_run())
    save_plain(*pretrain.build(run), TrialDir(folder).final_model, 6)
    return str(folder)


def cases(tmp_path: Path) -> dict[str, dict]:
    roberta = roberta_folder(tmp_path / "roberta")
    lora_roberta = {"name": "lora", "rank": 4, "target_modules": ["query", "value", "dense"]}
    body = {"from": pretrained_trial(tmp_path / "body")}
    tied = {**micro_run(), "model": tied_llama_folder(tmp_path / "tied"),
            "method": {"name": "lowrank", "rank": 8}}
    return {**{label: {**micro_run(), "method": m} for label, m in MERGED.items()},
            "tied_head_lowrank": tied,
            "glue_llama_full": glue("llama_micro", {"name": "full"}),
            "glue_llama_lora": glue("llama_micro", {"name": "lora", "rank": 4}),
            "glue_roberta_lora": glue(roberta, lora_roberta, dropout=0.1),
            "glue_from_a_trial_lowrank": glue(body, {"name": "lowrank", "rank": 8})}


def test_each_merging_method_and_glue_streams_the_files_the_whole_export_writes(tmp_path,
                                                                               monkeypatch):
    """For LoRA, ReLoRA, low-rank (on a tied head too), APOLLO (its INT8 weights too), Q-GaLore
    (simulated too), and GLUE classifiers (LLaMA full and LoRA, RoBERTa LoRA, low-rank on a
    pretraining trial's body, `model: {from: ...}`): every file equal byte for byte to the
    export of the model built whole, merged by the method, from a one-process checkpoint or a
    sharded one (alternately); no whole model is built."""
    whole_generating = export.generating
    for i, (label, data) in enumerate(cases(tmp_path).items()):
        run = load_run(data)
        kind = ("sharded", "one-process")[i % 2]  # each read path under half the cases
        states = trained_states(run, tmp_path / label, sharded=kind == "sharded")
        save_plain(*whole_generating(run, states["one-process"]), tmp_path / label / "whole", 3,
                   record=False)
        want = files(tmp_path / label / "whole")
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(want), label
        monkeypatch.setattr(export, "generating", no_whole_model)
        size = export.write_model(run, states[kind], tmp_path / label / kind, 3, record=False)
        monkeypatch.setattr(export, "generating", whole_generating)
        got = files(tmp_path / label / kind)
        assert got.keys() == want.keys(), label
        assert [n for n in want if got[n] != want[n]] == [], label
        assert size == sum(len(b) for b in want.values())


def no_whole_model(*_):
    raise AssertionError("the whole model was built")


def test_a_unit_is_computed_once_per_pass_and_freed_before_the_next(tmp_path, monkeypatch):
    """LoRA on llama_micro: the write and the read-back each compute every unit that holds
    weights once (2 layers, embedding, norm, head: 5, twice), and the unit held is dropped
    before the next is computed: at most one unit's tensors on the host at a time."""
    run = load_run({**micro_run(), "method": {"name": "lora", "rank": 4}})
    state = trained_states(run, tmp_path)["sharded"]
    computed, held_then = [], []
    real = stream_export.ByUnit.__init__

    def counting(self, owner, compute):
        def wrapped(unit):
            held_then.append(len(self.held))
            computed.append(unit)
            return compute(unit)
        real(self, owner, wrapped)

    monkeypatch.setattr(stream_export.ByUnit, "__init__", counting)
    export.write_model(run, state, tmp_path / "out", 3, record=False)
    units = ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert sorted(computed) == sorted(units * 2)
    assert held_then == [0] * 10


def test_qlora_is_exported_whole(tmp_path, monkeypatch):
    """QLoRA's `prepare` quantizes each weight to NF4 as it builds it (bitsandbytes), which
    the meta device cannot: its model is built whole, as before."""
    run = load_run({**micro_run(), "method": {"name": "qlora", "rank": 4}})
    saved = []
    monkeypatch.setattr(export, "generating", lambda run, state: ("merged", "tok"))
    monkeypatch.setattr(export, "save_plain", lambda *args, **kw: saved.append(args) or 7)
    assert export.write_model(run, {"model": {}, "step": 1}, tmp_path / "out", 1) == 7
    assert saved == [("merged", "tok", tmp_path / "out", 1, True)]


PEAK = """
import json, sys, threading, time
from pathlib import Path
from harness.methods import Method, build_method
from harness.methods.resolve import load_run
from harness.train import export
sys.path.insert(0, "tests")
from conftest import micro_run

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

for folder, method, out in json.loads(sys.argv[1]):
    run = load_run({**micro_run(), "model": "llama_130m", "method": method})
    state = {"sharded": Path(folder), "record": {}, "step": 1}
    export.skeleton_of(run, build_method(run))  # the imports and the tokenizer, outside
    base, peak, done = anon(), [0], []

    def watch():
        while not done:
            peak[0] = max(peak[0], anon())
            time.sleep(0.001)

    t = threading.Thread(target=watch)
    t.start()
    export.write_model(run, state, Path(out), 1, record=False)
    done.append(1)
    t.join()
    print(peak[0] - base)
"""


def units_bytes(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """A plain LLaMA's bytes per unit: each decoder layer, and each module beside them."""
    found: dict[str, int] = {}
    for name, t in weights.items():
        parts = name.split(".")
        unit = ".".join(parts[:3] if parts[1] == "layers" else parts[:-1])
        found[unit] = found.get(unit, 0) + t.numel() * t.element_size()
    return found


def test_a_streamed_exports_host_memory_is_about_one_unit(tmp_path):
    """llama_130m (372 MiB in float32 with the sample tokenizer, its largest tensor the 24 MiB
    embedding, its largest unit a 27 MiB decoder layer), exported from sharded checkpoints in
    one child process. As trained (full): the process's anonymous memory grows by at most
    twice the largest tensor plus 16 MiB (measured 55 MiB in 3 runs; the whole model built on
    the host, as before, grew it by 428 MiB). With LoRA (its adapters merged a unit at a time):
    by at most twice the largest unit plus 16 MiB (measured 56 MiB). glibc's mmap threshold
    is fixed so that a freed tensor leaves the measure (else the heap keeps it: 56 to 108 MiB)."""
    cases = []
    for label, method in (("full", {"name": "full"}), ("lora", {"name": "lora", "rank": 8})):
        run = load_run({**micro_run(), "model": "llama_130m", "method": method})
        model, _ = pretrain.build(run)
        weights = build_method(run).prepare(model, run).state_dict()
        dcp.save(weights, checkpoint_id=tmp_path / label / "model", no_dist=True)
        cases.append((str(tmp_path / label), method, str(tmp_path / f"out-{label}")))
        del model, weights
    done = subprocess.run([sys.executable, "-c", PEAK, json.dumps(cases)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert done.returncode == 0, done.stderr
    full, lora = (int(line) for line in done.stdout.split()[-2:])
    from safetensors.torch import load_file

    plain = load_file(str(tmp_path / "out-lora" / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in plain.values())
    largest = max(t.numel() * t.element_size() for t in plain.values())
    unit = max(units_bytes(plain).values())
    print(f"model {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB, "
          f"largest unit {unit / 2**20:.1f} MiB; export grew: full {full / 2**20:.1f} MiB, "
          f"lora {lora / 2**20:.1f} MiB")
    assert total > 300 * 2**20 and unit > largest
    assert full <= 2 * largest + 16 * 2**20
    assert lora <= 2 * unit + 16 * 2**20
