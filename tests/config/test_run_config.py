"""harness/config/run.py: the typed run config, its defaults and cross-checks, the one-line
validation messages, YAML reading, --set overrides and the identity hash of a trial."""

from __future__ import annotations

import pytest
from conftest import micro_run, write_yaml

from harness.config import (
    MemoryConfig,
    RunConfig,
    SweepConfig,
    TaskConfig,
    TrainConfig,
    memory_label,
    parse_overrides,
    read_yaml,
    set_dotted,
    validate,
)
from harness.errors import UserError


def test_budget_is_steps_or_epochs_with_100_steps_by_default():
    assert TrainConfig().steps == 100 and TrainConfig().epochs is None
    epochs = TrainConfig(epochs=3)
    assert (epochs.steps, epochs.epochs) == (None, 3)
    with pytest.raises(UserError, match=r"^train: set train.steps or train.epochs, not both"):
        validate(RunConfig, {"train": {"steps": 5, "epochs": 2}})


def test_accumulation_is_total_over_micro_batch():
    assert TrainConfig(batch_size=4).accumulation == 1
    assert TrainConfig(batch_size=4, total_batch_size=32).accumulation == 8
    with pytest.raises(UserError, match=r"^train: total_batch_size 10 is not a multiple of "
                                        r"batch_size 4"):
        validate(RunConfig, {"train": {"batch_size": 4, "total_batch_size": 10}})


def test_memory_modifier_lists_and_their_words():
    memory = MemoryConfig(recompute=["attention"], offload=["mlp", "norm"])
    assert (memory.recomputed, memory.offloaded) == (["attention"], ["mlp", "norm"])
    full = MemoryConfig(recompute="full")
    assert (full.recomputed, full.offloaded) == ([], [])
    with pytest.raises(UserError, match=r"^memory.offload: \['mlp', 'mlp'\] names a module "
                                        r"kind twice"):
        validate(RunConfig, {"memory": {"offload": ["mlp", "mlp"]}})
    with pytest.raises(UserError, match=r"^memory.recompute: \[\] is not allowed"):
        validate(RunConfig, {"memory": {"recompute": []}})


def test_memory_label_in_a_few_words():
    assert memory_label({}) == "none"
    assert memory_label({"recompute": "none", "offload": "none", "layerwise": False,
                         "optimizer_offload": "none"}) == "none"
    assert memory_label({"recompute": ["attention", "mlp"], "offload": ["norm"],
                         "layerwise": True, "optimizer_offload": "host"}) == (
        "recompute attention+mlp, offload norm, layerwise, optimizer host")
    assert memory_label({"recompute": "full"}) == "recompute full"


def test_glue_task_checks():
    assert TaskConfig(kind="glue").glue_task == "sample"
    with pytest.raises(UserError, match=r"^task: glue_task: 'cola2' is not a task \(allowed: "
                                        r"cola, sst2"):
        validate(RunConfig, {"task": {"kind": "glue", "glue_task": "cola2"}})
    with pytest.raises(UserError, match=r"^task: dataset: 'sample' holds only the embedded task; "
                                        r"GLUE mrpc reads from hub"):
        validate(RunConfig, {"task": {"kind": "glue", "glue_task": "mrpc"}})
    assert TaskConfig(kind="glue", glue_task="mrpc", dataset="hub").dataset == "hub"


def test_fp16_with_layerwise_is_refused_in_a_sweep_too():
    with pytest.raises(UserError, match=r"^config: memory.layerwise with train.precision fp16"):
        validate(SweepConfig, {"name": "s", "methods": {"full": {}},
                               "train": {"precision": "fp16"}, "memory": {"layerwise": True}})


def test_validation_messages_name_the_path_and_what_is_allowed():
    with pytest.raises(UserError) as e:
        validate(RunConfig, {"eval": {"tokns": 5}})
    assert str(e.value) == ("unknown key 'eval.tokns' (did you mean 'tokens'? allowed: every, "
                            "tokens, batch_size)")
    with pytest.raises(UserError, match=r"^missing key 'name'"):
        validate(SweepConfig, {"methods": {"full": {}}})
    with pytest.raises(UserError, match=r"^task.seq_len: 1 is invalid \(Input should be "
                                        r"greater than or equal to 2\)$"):
        validate(RunConfig, {"task": {"seq_len": 1}})
    with pytest.raises(UserError, match=r"^train.lr: -1 is invalid .* \(and 1 more problem\)$"):
        validate(RunConfig, {"train": {"lr": -1, "warmup_steps": -1}})
    with pytest.raises(UserError, match=r"\(and 2 more problems\)$"):
        validate(RunConfig, {"train": {"lr": -1, "warmup_steps": -1, "log_every": 0}})
    with pytest.raises(UserError, match=r"^sweep.device: 'tpu' is not allowed \(allowed: 'auto'"):
        validate(RunConfig, {"device": "tpu"}, prefix="sweep.")


def test_identity_ignores_names_and_logging_but_not_what_changes_results():
    base = validate(RunConfig, micro_run())
    same = validate(RunConfig, {**micro_run(log_every=5, keep_checkpoints=5, peer_timeout_s=9),
                                "name": "other",
                                "label": "x", "provenance": {"git": "abc"},
                                "wandb": {"enabled": True}})
    assert base.identity() == same.identity()
    assert len(base.identity()) == 8 and int(base.identity(), 16) >= 0
    for changed in (micro_run(lr=0.004), {**micro_run(), "seed": 1},
                    {**micro_run(), "memory": {"recompute": "full"}}):
        assert validate(RunConfig, changed).identity() != base.identity()


def test_method_name_and_params():
    run = RunConfig(method={"name": "galore", "rank": 8})
    assert (run.method_name, run.method_params) == ("galore", {"rank": 8})


def test_read_yaml(tmp_path):
    path = write_yaml(tmp_path / "run.yaml", micro_run())
    assert read_yaml(path) == micro_run()
    with pytest.raises(UserError, match=r"^config file not found: .*missing.yaml$"):
        read_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("train:\n  lr: [1,\n")
    with pytest.raises(UserError, match=r"bad.yaml line \d+: not valid YAML"):
        read_yaml(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match=r"list.yaml: expected a mapping of keys at the top"):
        read_yaml(tmp_path / "list.yaml")


def test_set_dotted_creates_mappings_and_refuses_to_enter_a_value():
    data = {"train": {"lr": 1}, "model": "llama_micro", "eval": None}
    set_dotted(data, "train.steps", 5)
    set_dotted(data, "memory.offload", ["mlp"])
    set_dotted(data, "eval.every", 2)
    assert data == {"train": {"lr": 1, "steps": 5}, "model": "llama_micro", "eval": {"every": 2},
                    "memory": {"offload": ["mlp"]}}
    with pytest.raises(UserError, match=r"^model.name: 'model' is not a mapping, cannot set"):
        set_dotted(data, "model.name", "x")


def test_overrides_are_yaml_values():
    assert parse_overrides(["train.lr=0.001", "task.packing=false", " seeds =[1, 2]",
                            "name=a=b"]) == {
        "train.lr": 1e-3, "task.packing": False, "seeds": [1, 2], "name": "a=b"}
    # YAML 1.1 reads 1e-3 (no dot) as a string; the typed config still takes it as the number
    data = micro_run()
    set_dotted(data, "train.lr", parse_overrides(["train.lr=1e-3"])["train.lr"])
    assert validate(RunConfig, data).train.lr == 1e-3
    for bad in ("train.lr", "=3"):
        with pytest.raises(UserError, match=r"^--set expects KEY=VALUE"):
            parse_overrides([bad])
    with pytest.raises(UserError, match=r"^--set memory: value '\[mlp' is not valid YAML"):
        parse_overrides(["memory=[mlp"])
