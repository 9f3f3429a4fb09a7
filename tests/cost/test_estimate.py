"""`harness estimate`: per-trial bytes from shapes alone, offline and fast up to 7B, and the
comparison with GaLore Table 2's memory column."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from conftest import SAMPLE_VOCAB, micro_model

from harness.config import SweepConfig
from harness.cost import estimate as est
from harness.data.c4 import load_tokenizer
from harness.models import PRESETS
from harness.sweep.plan.expand import estimate_sweep, expand, load_sweep

KEYS = {"trial", "method", "method_name", "params", "weight_bytes", "grad_bytes",
        "optimizer_state_bytes", "extra_bytes", "total_bytes", "activation_bytes",
        "workspace_bytes", "peak_bytes", "checkpoint_bytes", "checkpoints_bytes",
        "final_model_bytes", "disk_peak_bytes", "disk_kept_bytes"}  # fmt: skip
# Other methods are being written beside these; these three are finished and exact.
FINISHED = ("full", "adam8bit", "lowrank")
PAPER_RANK = {"llama_60m": 128, "llama_130m": 256, "llama_350m": 256, "llama_1b": 512}


def finished_only(path: str) -> SweepConfig:
    sweep = load_sweep(path, {})
    sweep.methods = {
        k: v for k, v in sweep.methods.items() if (v or {}).get("method", k) in FINISHED
    }
    return sweep


def sweep_file(tmp_path, **data) -> SweepConfig:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "x", **data}))
    return load_sweep(path, {})


def points(sweep: SweepConfig) -> dict[str, tuple[float, dict]]:
    return {t.id: (t.run.train.lr, t.point) for t in expand(sweep)}


def no_tokenizer(monkeypatch) -> None:
    def refuse(name):
        raise AssertionError(f"tokenizer {name} loaded")

    monkeypatch.setattr("harness.data.c4.load_tokenizer", refuse)


def llama_params(preset: str, vocab: int) -> int:
    p = PRESETS[preset]
    per_layer = 4 * p.hidden**2 + 3 * p.hidden * p.intermediate + 2 * p.hidden
    return 2 * vocab * p.hidden + p.layers * per_layer + p.hidden


@pytest.mark.parametrize("path", ["sweeps/quickstart.yaml", "sweeps/c4_1b.yaml"])
def test_one_record_per_trial_with_every_key_and_totals_that_add_up(path, monkeypatch):
    no_tokenizer(monkeypatch)
    sweep = finished_only(path)
    records = estimate_sweep(sweep)
    assert [r["trial"] for r in records] == [t.id for t in expand(sweep)]
    for r in records:
        assert r.keys() == KEYS
        assert r["total_bytes"] == sum(r[k] for k in est.BYTE_FIELDS) > 0
        assert r["peak_bytes"] > r["total_bytes"] - r["grad_bytes"]  # activations come on top
        assert r["workspace_bytes"] == 2 * 32 * 2**20  # a sweep's device is CUDA by default
    json_records = json.loads(est.to_json(records))
    assert [r["total_bytes"] for r in json_records] == [r["total_bytes"] for r in records]
    table = est.format_table(records, points(sweep))
    assert "GB" in table or "MB" in table


def test_shapes_are_the_trainers_model_and_the_sample_vocab_is_its_tokenizers(
        tmp_path, sample_tokenizer):
    assert est.KNOWN_VOCAB["sample"] == len(sample_tokenizer) == SAMPLE_VOCAB
    sweep = sweep_file(tmp_path, model="llama_tiny", task={"seq_len": 128}, methods={"full": {}})
    model = micro_model(None, "llama_tiny", len(sample_tokenizer), 128, pad_id=0)
    (record,) = estimate_sweep(sweep)
    assert record["weight_bytes"] == 4 * sum(p.numel() for p in model.parameters())


def test_a_tokenizer_of_unknown_size_is_loaded_once(tmp_path, monkeypatch, sample_tokenizer):
    folder = str(sample_tokenizer.name_or_path)
    calls = []
    monkeypatch.setattr(
        "harness.data.c4.load_tokenizer", lambda name: calls.append(name) or load_tokenizer(name)
    )
    est.vocab_size.cache_clear()
    task = {"tokenizer": folder, "seq_len": 32}
    space = {"train.lr": [0.1, 0.2]}
    sweep = sweep_file(
        tmp_path, model="llama_micro", task=task, methods={"full": {}}, search={"space": space}
    )
    records = estimate_sweep(sweep)
    assert calls == [folder] and len(records) == 2
    assert records[0]["weight_bytes"] == 4 * llama_params("llama_micro", SAMPLE_VOCAB)


def test_shapes_are_built_once_per_model_and_vocab(monkeypatch):
    calls = []
    real = est.param_shapes
    monkeypatch.setattr(est, "param_shapes", lambda *a: calls.append(a) or real(*a))
    est._shapes.cache_clear()
    records = estimate_sweep(finished_only("sweeps/c4_1b.yaml"))
    assert len(records) >= 6 and calls == [("llama_1b", 32100)]


def test_8bit_moments_are_a_quarter_of_fp32_ones_at_1b(monkeypatch):
    no_tokenizer(monkeypatch)
    records = estimate_sweep(finished_only("sweeps/c4_1b.yaml"))
    state = {r["method"]: r["optimizer_state_bytes"] for r in records}
    # 1 byte a moment instead of 4, plus a 4-byte absmax per 256-element block: just under 4
    assert state["full"] / state["adam8bit"] == pytest.approx(8 / (2 * (1 + 4 / 256)), rel=1e-3)
    weights = {r["method"]: r["weight_bytes"] for r in records}
    assert weights["full"] == weights["adam8bit"] == 4 * llama_params("llama_1b", 32100)


def test_7b_is_estimated_offline_in_seconds(tmp_path, monkeypatch):
    no_tokenizer(monkeypatch)
    est._shapes.cache_clear()
    sweep = sweep_file(tmp_path, model="llama_7b", task={"tokenizer": "t5-base", "seq_len": 256},
                       methods={"full": {}})  # fmt: skip
    start = time.perf_counter()
    (record,) = estimate_sweep(sweep)
    assert time.perf_counter() - start < 10
    n = llama_params("llama_7b", 32100)
    assert 6.7e9 < n < 6.8e9
    assert (record["weight_bytes"], record["grad_bytes"]) == (4 * n, 4 * n)
    assert "GB" in est.format_table([record], points(sweep))


def test_one_row_per_distinct_configuration_with_its_learning_rates(capsys):
    """c4_1b.yaml: 25 method entries (13, and issue 69's 12 contenders), 5 learning rates each
    (Q-GaLore 3), one seed: 123 trials, 25 rows; the table, what follows it and GaLore Table 2
    beside it keep to 120 columns."""
    from harness.cli import main

    assert main(["estimate", "sweeps/c4_1b.yaml"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120
    header = lines[0].split()
    assert header[:2] == ["method", "lr"] and "trial" not in header
    rows = {line.split()[0]: line for line in lines[2:lines.index("set hyperparameters:")]}
    assert len(rows) == 25 and "-" not in "".join(rows)  # no trial ids (label-hash)
    assert rows["full"].split()[1:6] == ["0.0001", "to", "0.01", "(5)", "5.36"]
    assert rows["qgalore"].split()[1:4] == ["0.005,", "0.01,", "0.015"]
    assert "  qgalore: betas=(0.9, 0.95), rank=1024, lazy_schedule=reference" in lines
    assert "GaLore Table 2, LLaMA 1B" in out


def test_a_space_over_more_than_the_lr_gets_a_column_per_key(capsys):
    """memory_gpu.yaml: 6 methods x 2 models x 5 modifier sets, one LR: 60 rows, each with
    its model and memory modifiers, wrapped to keep to 120 columns."""
    from harness.cli import main

    assert main(["estimate", "sweeps/memory_gpu.yaml"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["method", "model", "memory", "lr"]
    assert max(map(len, lines)) <= 120
    table = lines[2:lines.index("set hyperparameters:")]
    rows = [line.split() for line in table if not line.startswith(" ")]  # not a wrapped line
    assert len(rows) == 60
    assert {(r[1], r[0]) for r in rows} == {(m, e) for m in ("llama_130m", "llama_350m") for e
                                            in ("full", "adam8bit", "lora", "galore",
                                                "galore_8bit", "qgalore")}


@pytest.mark.parametrize(("lrs", "text"), [
    ([0.001], "0.001"), ([0.003, 0.001, 0.003], "0.001, 0.003"),
    ([0.01, 0.005, 0.015], "0.005, 0.01, 0.015"),
    ([0.01, 0.0001, 0.005, 0.0005, 0.001], "0.0001 to 0.01 (5)")])  # fmt: skip
def test_learning_rates_listed_up_to_three_then_as_a_range(lrs, text):
    assert est.lr_text(lrs) == text


def test_human_units_are_decimal():
    from harness.config.metrics import human_bytes

    sizes = (1_500_000_000, 2_500_000, 1_500, 999)
    assert [human_bytes(n) for n in sizes] == ["1.50 GB", "2.5 MB", "1.5 kB", "999 B"]


@pytest.mark.parametrize("model", list(PAPER_RANK))
def test_full_and_low_rank_match_galore_table_2_within_tolerance(tmp_path, model):
    sweep = sweep_file(tmp_path, model=model, task={"tokenizer": "t5-base", "seq_len": 256},
                       methods={"full": {}, "lowrank": {"rank": PAPER_RANK[model]}})  # fmt: skip
    records = estimate_sweep(sweep)
    paper = est.paper_table()
    size = est.PAPER_MODELS[model]
    for r, name in zip(records, ["Full-rank", "Low-rank"], strict=True):
        ours_gb = est.paper_bytes(r) / 1e9
        assert ours_gb == pytest.approx(paper[name, size], rel=est.PAPER_TOLERANCE)
    text = est.paper_comparison(records, sweep)
    assert f"LLaMA {size}" in text and "Full-rank" in text and "Low-rank" in text
    assert "!" not in text
    assert f"{paper['Full-rank', size]:.2f}" in text


def test_paper_table_holds_all_of_table_2_and_other_models_get_no_comparison(tmp_path):
    paper = est.paper_table()
    assert len(paper) == 20 and paper["Full-rank", "1B"] == 7.80 and paper["GaLore", "60M"] == 0.24
    sweep = sweep_file(tmp_path, model="llama_tiny", methods={"full": {}})
    assert est.paper_comparison(estimate_sweep(sweep), sweep) == ""


def test_a_rank_far_from_the_papers_is_flagged(tmp_path):
    sweep = sweep_file(tmp_path, model="llama_60m", task={"tokenizer": "t5-base"},
                       methods={"lowrank": {"rank": 8}})  # fmt: skip
    text = est.paper_comparison(estimate_sweep(sweep), sweep)
    assert "rank=8" in text and "!" in text


def test_fsdp_estimates_rank_zeros_rows_of_every_tensor(tmp_path):
    """4 ranks under fsdp: rank 0's weights and AdamW's two moments are its ceil(m / 4) rows of
    each of the trainer's tensors, counted here from the model itself; the peak (checked
    against measured runs in tests/cost/test_sharded.py) is below one process's."""
    run = {"model": "llama_micro", "task": {"dataset": "sample", "tokenizer": "sample",
                                            "seq_len": 32}, "methods": {"full": {}},
           "train": {"batch_size": 2, "total_batch_size": 8, "parallel": "fsdp"},
           "launcher": {"kind": "submitit-local", "tasks_per_node": 4}}
    (sharded,) = estimate_sweep(sweep_file(tmp_path, **run))
    run["launcher"] = {"kind": "local"}
    (whole,) = estimate_sweep(sweep_file(tmp_path, **run))
    rows = sum(-(-p.shape[0] // 4) * p[0].numel() for p in micro_model().parameters())
    assert sharded["weight_bytes"] == sharded["grad_bytes"] == 4 * rows
    assert 8 * rows <= sharded["optimizer_state_bytes"] <= 8 * rows + 4 * 100  # + step counters
    assert sharded["peak_bytes"] < whole["peak_bytes"]


def test_the_7b_fsdp_sweep_gives_each_of_64_gpus_its_share(monkeypatch):
    """sweeps/c4_7b_fsdp.yaml: rank 0 of 64 holds ceil(m / 64) rows of each of LLaMA-7B's
    tensors (counted from the meta model's shapes) in float32, full AdamW's peak fits an 80 GB
    GPU, and GaLore's rank-1024 bases are a right basis Q (1024 × 4096) whole for each of the 6
    q, k, v, o, gate, up matrices of a layer and 4096 / 64 rows of the down projection's left P
    (4096 × 1024), less than the 1-process figure (P whole)."""
    from harness.models import param_shapes

    records = estimate_sweep(load_sweep("sweeps/c4_7b_fsdp.yaml", {}))
    shapes = param_shapes("llama_7b", 32100)
    rows = sum(-(-s[0] // 64) * (s.numel() // s[0]) for s in shapes.values())
    full = next(r for r in records if r["method_name"] == "full")
    assert full["weight_bytes"] == full["grad_bytes"] == 4 * rows
    assert full["peak_bytes"] < 80e9
    galore = next(r for r in records if r["method_name"] == "galore")
    one = load_sweep("sweeps/c4_7b_fsdp.yaml", {"train.parallel": "ddp"})
    one.methods = {"galore": one.methods["galore"]}
    one.launcher = one.launcher.model_copy(update={"nodes": 1, "tasks_per_node": 1})
    assert galore["extra_bytes"] == 4 * 32 * (6 * 1024 * 4096 + 64 * 1024)
    assert estimate_sweep(one)[0]["extra_bytes"] == 4 * 32 * (6 * 1024 * 4096 + 4096 * 1024)


def test_a_padded_mlp_is_estimated_at_its_width_and_told_apart_from_the_papers(tmp_path):
    """LLaMA-1B at mlp_multiple_of 64: 5504 instead of 5461, 43 more columns in each of 24 x 3
    MLP matrices of 2048 rows, 4 bytes each in fp32; Table 2's comparison says the width."""
    task = {"tokenizer": "t5-base", "seq_len": 256}
    paper = sweep_file(tmp_path, model="llama_1b", task=task, methods={"full": {}})
    padded = sweep_file(tmp_path, model="llama_1b", task=task, methods={"full": {}},
                        model_options={"mlp_multiple_of": 64})
    (ours,), (theirs,) = estimate_sweep(padded), estimate_sweep(paper)
    assert ours["weight_bytes"] - theirs["weight_bytes"] == 4 * 24 * 3 * 2048 * 43
    assert ours["activation_bytes"] > theirs["activation_bytes"]  # the MLP's saved activations
    assert "ours at MLP width 5504 (model_options), not the paper's 5461" in (
        est.paper_comparison([ours], padded))
    assert "MLP width" not in est.paper_comparison([theirs], paper)
