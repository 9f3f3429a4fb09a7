"""FSDP2 (`train.parallel: fsdp`): 2 and 4 processes (gloo, CPU) train as 1 process does, each
writes its shards of the checkpoint, which read whole is the 1-process one, and a trial stopped
at one world size resumes at another, or at the same one.

Every trial runs on one thread, so kernels sum in the same order; what differs from the
1-process run is the order of the gradient reductions (a reduce-scatter over W ranks instead of
one process's sums), which moves losses by ~1e-7 relative: the tolerance is DDP's, 1e-5.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_port, hf_eval_loss, micro_run, ranks, write_yaml
from fsdp_ranks import HEADER
from ranks import Ranks
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.config import read_yaml
from harness.distributed.rows import Rows
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.train import train
from harness.train.export import export_trial, generating
from harness.train.plain import newest_state, save_plain
from harness.trials import TrialDir, read_json, read_jsonl


def fsdp_run(steps: int = 6, **train_keys: Any) -> dict[str, Any]:
    """8 sequences a step in micro-batches of 2: 4 processes take one each, 2 accumulate two;
    the final checkpoint kept (`state` reads it) unless `keep_final` says otherwise."""
    train_keys.setdefault("keep_final", "full")
    data = micro_run(steps=steps, total_batch_size=8, parallel="fsdp", **train_keys)
    return {**data, "eval": {"every": 3, "tokens": 256}}


def losses(out: Path) -> list[tuple[str, int, float]]:
    return [(r["kind"], r["step"], r.get("loss", r.get("eval_loss")))
            for r in read_jsonl(out / "metrics.jsonl") if r["kind"] in ("train", "eval")]


def assert_same_losses(one: Path, other: Path) -> None:
    a, b = losses(one), losses(other)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert [x[2] for x in b] == pytest.approx([x[2] for x in a], rel=1e-5, abs=0)


def run_procs(data: dict[str, Any], out: Path, procs: int) -> str:
    proc = ranks(write_yaml(out.with_suffix(".yaml"), data), out, procs)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    return output


def launch(configs: list[Path], procs: int, stop: int | None = None) -> dict[Path, str]:
    """Every trial of `configs` in one launch of `procs` ranks (tests/train/fsdp_ranks.py),
    each by `harness train` (`stop`: stopped after that step); each trial's folder -> the
    output from its start to the next trial's."""
    argv = [*(["--stop", str(stop)] if stop is not None else []),
            *(x for path in configs for x in (str(path), str(free_port())))]
    proc = Ranks(argv, procs, free_port(), "fsdp_ranks")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    parts = {Path(part.split("\n", 1)[0]): part for part in output.split(HEADER)[1:]}
    assert list(parts) == [path.with_suffix("") for path in configs], output
    return parts


def state(out: Path) -> dict[str, Any]:
    """The newest checkpoint, whole. A sharded one (a folder) is read by torch's own converter
    of a torch.distributed.checkpoint folder into one torch.save file, a part at a time: the
    model by parameter name, the optimizer flattened (`state.<name>.<key>`)."""
    path = out / "checkpoint" / "state.pt"
    if not path.is_dir():
        return torch.load(path, weights_only=False)
    rest = torch.load(path / "rest.pt", weights_only=False)
    for part in ("model", "optimizer"):
        dcp_to_torch_save(path / part, out / f"{part}.pt")
        rest[part] = torch.load(out / f"{part}.pt", weights_only=False)
    return rest


def named_states(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A flattened optimizer state dict's states by parameter name: {name: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            name, _, state_key = key[len("state."):].rpartition(".")
            out.setdefault(name, {})[state_key] = value
    return out


def index_states(opt: dict[str, Any]) -> list[dict[str, Any]]:
    """A one-process optimizer state dict's per-parameter states (layer-wise: every inner one's)."""
    return [st for inner in opt.get("inner", [opt]) for st in inner["state"].values()]


def state_shapes(states: Any) -> list[str]:
    """Each parameter's states as {key: shape}, sorted: comparable whatever keys them."""
    return sorted(repr(sorted((k, getattr(v, "shape", v)) for k, v in st.items() if k != "step"))
                  for st in states)


FULL = {"name": "full"}
GALORE = {"name": "galore", "rank": 8, "update_proj_gap": 3}  # refreshes at steps 1 and 4
FIRA = {"name": "fira", "rank": 8, "update_proj_gap": 3}
ADAM8BIT = {"name": "adam8bit", "min_8bit_size": 256}  # 8-bit states for every matrix
# rank 32: a right side's moments split into whole blocks (88 rows x 32 = 11 blocks a rank)
GALORE_8BIT = {**GALORE, "rank": 32, "optimizer": "adam8bit", "min_8bit_size": 256}
APOLLO = {"name": "apollo", "rank": 8, "update_proj_gap": 3}  # new projections at steps 1 and 4
RELORA = {"name": "relora", "rank": 4, "reset_every": 2, "restart_warmup_steps": 1}  # 2 merges
MUON = {"name": "muon"}
ADAM4BIT = {"name": "adam4bit", "compile_step": False}  # eager: no compile a case
# Final weights against 1 process: Adam's m/√v turns a 1e-7 difference in a near-zero gradient
# into up to lr·1e-2 (measured 1.3e-5); GaLore's SVD turns it into a basis 7.7e-5 away
# (measured on the weights: 9.9e-5 with 4 processes). ReLoRA's magnitude pruning zeroes the
# moments at or below their 0.999 quantile: an entry within that 1e-7 of it is pruned in one run
# and kept in the other, and its next updates differ (measured 6.3e-4 on 59 of 4,096 entries of
# one weight, 2 processes; with random pruning, whose mask is drawn whole, within 5e-5).
# Fira takes GaLore's bases: measured 6.0e-5 (one embedding entry, 4 processes). 8-bit Adam
# rounds each moment to one of 256 levels of its block: an entry within 1e-7 of a boundary
# rounds to the neighbour in one run, and its update moves by up to 8% of lr (measured 4.8e-4
# on 15 of 524,288 embedding entries, 4 processes); GaLore's 8-bit inner Adam runs the same
# blockwise kernel, so the same bound (measured 4.7e-4 on 1 of 524,288 embedding entries, 2
# processes, layer-wise, on a CPU where bitsandbytes takes its AVX2 path; under 3e-4 where it
# takes its AVX-512 one). Muon's Newton–Schulz runs
# in bf16: a 1e-7 difference in the gathered update rounds some entries to the neighbouring bf16
# value, each hidden matrix ends up to 1.9e-4 away, and the embedding entries whose gradients
# are near zero then take AdamW steps of the other sign (measured 1.04e-2 on 18 of 524,288
# entries, 2 processes: about 3 steps of lr); the losses still agree as every method's do.
# (8-bit Adam: 2.6e-3 over 12 steps; tests/train/test_equality.py's bound, 4e-3, here too)
WEIGHT_ATOL = {"galore": 3e-4, "fira": 3e-4, "relora": 2e-3, "adam8bit": 4e-3, "muon": 2e-2}


# Full at 2, GaLore at 2 and APOLLO(-Mini) at 4 train in test_equality.py's matrix (losses,
# weights, states by name, grad norm, rank 0's bytes); here what it leaves out: the CLI, the
# sharded checkpoint's files and states by name, and the modifiers. Full on 4 plainly: the
# 4-galore case makes each of its assertions (its embedding, head and norms step as AdamW's)
# and test_equality.py trains full on 4 processes.
@pytest.mark.parametrize(("procs", "method", "memory"), [
    (2, FULL, {"layerwise": True}), (2, FULL, {"recompute": "full"}),
    (4, GALORE, {}), (4, {**RELORA, "prune": "random"}, {}),
    (2, GALORE_8BIT, {"layerwise": True}), (4, MUON, {"layerwise": True}),
], ids=["2-layerwise", "2-recompute", "4-galore", "4-relora-random",
        "2-galore-8bit-layerwise", "4-muon-layerwise"])
def test_fsdp_trains_as_one_process(tmp_path, procs, method, memory):
    """Through `harness train` and its sharded checkpoint; every method and strategy, both
    precisions, with and without accumulation: tests/train/test_equality.py. Layer-wise: FSDP
    runs each parameter's hook on its reduced shard, which clips (the norm over the shards)
    and steps it; recompute: the gathered layer runs its forward again. GaLore over two
    refreshes, between them a right side projecting its rows and a left side all-reducing PᵀG.
    On 4: a query's 64 rows in 2 heads of 32 over shards of 16."""
    data = {**fsdp_run(), "method": method, "memory": memory}
    output = run_procs(data, tmp_path / "many", procs)
    one = train(load_run(data), tmp_path / "one")
    many = read_json(tmp_path / "many" / "summary.json")
    assert one["status"] == many["status"] == "ok"
    assert_same_losses(tmp_path / "one", tmp_path / "many")
    if memory.get("layerwise"):  # each gradient used and freed in backward: no global norm
        assert one["grad_norm"] is None and many["grad_norm"] is None
    else:  # over every rank's shards, as one process's over its whole gradients; float32 sums
        assert many["grad_norm"] > 0  # of 1.1M squares in another order: measured 1.4e-5 apart
        assert many["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-4)
    assert output.count("step 6/6") == 1  # progress from rank 0 only
    if not memory:  # rank 0 holds its rows of each weight: ceil(m / W) of m, counted by hand
        rows = sum(-(-s[0] // procs) * (s.numel() // s[0]) for s in
                   (p.shape for p in state(tmp_path / "one")["model"].values()))
        assert read_json(tmp_path / "many" / "summary.json")["param_bytes"] == 4 * rows
    # each rank wrote its shards; read whole, they are the 1-process checkpoint's keys and
    # shapes, values within what the reduction order moves (above; the first moments within
    # 2e-6: measured 5e-7)
    folder = tmp_path / "many" / "checkpoint" / "state.pt"
    assert {p.name for p in folder.iterdir()} == {"model", "optimizer", "rest.pt"}
    for part in ("model", "optimizer"):
        assert {p.name for p in (folder / part).iterdir()} == \
            {f"__{r}_0.distcp" for r in range(procs)} | {".metadata"}
    a, b = state(tmp_path / "one"), state(tmp_path / "many")
    kernel = "adam8bit" if method.get("optimizer") == "adam8bit" else method["name"]
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert b["model"][key].shape == value.shape
        torch.testing.assert_close(b["model"][key], value, rtol=0,
                                   atol=WEIGHT_ATOL.get(kernel, 5e-5))
    # the optimizer's states by parameter name: the same keys and shapes as one process's (which
    # are by index), each first moment within the bound of the one process's of that shape
    theirs = named_states(b["optimizer"])
    ours = index_states(a["optimizer"])
    assert state_shapes(theirs.values()) == state_shapes(ours)
    # 8-bit codes: through the losses and weights above (a moment near a level boundary rounds
    # to either side; a block's scale then drifts up to 0.9%, measured on 4 processes); Muon's
    # bf16 spread above moves the embedding's gradients and so its AdamW moments (1.26e-5)
    atol = 3e-5 if method["name"] == "muon" else 2e-6
    left = [st["exp_avg"] for st in theirs.values() if "exp_avg" in st]
    for st in ours:
        if "exp_avg" in st:
            match = [i for i, t in enumerate(left) if t.shape == st["exp_avg"].shape
                     and torch.allclose(t, st["exp_avg"], rtol=0, atol=atol)]
            assert match, f"no state by name within {atol} of one shaped {st['exp_avg'].shape}"
            left.pop(match[0])


@pytest.mark.parametrize("precision", ["bf16-true"])  # bf16-mixed: test_equality.py, 1e-4
def test_fsdp_trains_in_bfloat16(tmp_path, precision):
    """bf16-mixed: float32 shards gathered, autocast (the 1-process numbers: test_equality.py);
    bf16-true: bfloat16 shards. The same training as float32: 4 steps take the eval loss from
    ln 8192 = 9.01 to 8.775 in float32, and bfloat16 ended within 2e-3 of it (measured:
    8.7756, 8.7772)."""
    data = {**fsdp_run(steps=4, precision=precision), "eval": {"every": 0, "tokens": 256}}
    run_procs(data, tmp_path / "two", 2)
    reference = train(load_run({**data, "train": {**data["train"], "precision": "32-true"}}),
                      tmp_path / "one")
    two = read_json(tmp_path / "two" / "summary.json")
    assert two["status"] == "ok"
    assert two["eval_loss"] == pytest.approx(reference["eval_loss"], abs=0.01)


@pytest.mark.parametrize("method", [{"name": "full"}, {"name": "lora", "rank": 4}],
                         ids=["full", "lora"])
def test_a_sharded_trials_final_model_is_whole_and_gives_its_eval_loss(tmp_path, method):
    """Under fsdp rank 0 consolidates the weights after the group is gone: the model
    transformers loads holds every weight whole and gives the trial's eval loss (1e-5, the
    export's bound: tests/train/test_export.py measured 9e-8 at most). Full (`keep_final:
    full`): `harness export` of its checkpoint reads the weights alone, with the optimizer's
    files gone, and writes the same tensors."""
    keep = "full" if method["name"] == "full" else "weights"
    data = {**fsdp_run(steps=3, keep_final=keep), "method": method}
    run_procs(data, tmp_path / "two", 2)
    summary = read_json(tmp_path / "two" / "summary.json")
    assert summary["status"] == "ok"
    assert (tmp_path / "two" / "checkpoint").exists() == (keep == "full")
    assert hf_eval_loss(tmp_path / "two" / "model", data["task"], data["eval"]["tokens"]) == \
        pytest.approx(summary["eval_loss"], rel=1e-5)
    if keep == "full":
        shutil.rmtree(tmp_path / "two" / "checkpoint" / "state.pt" / "optimizer")
        (tmp_path / "two" / "model.json").unlink()  # no final model: from the checkpoint
        export_trial(tmp_path / "two", tmp_path / "exported")
        final = load_file(tmp_path / "two" / "model" / "model.safetensors")
        exported = load_file(tmp_path / "exported" / "model.safetensors")
        assert final.keys() == exported.keys()
        assert all(torch.equal(final[k], exported[k]) for k in final)
        # streamed from 2 ranks' shards: every file the whole model's save writes, byte for byte
        save_plain(*generating(load_run(data), newest_state(TrialDir(tmp_path / "two"))),
                   tmp_path / "whole", 3, record=False)
        for path in sorted((tmp_path / "whole").iterdir()):
            assert (tmp_path / "exported" / path.name).read_bytes() == path.read_bytes(), path


def stop_after(data: dict[str, Any], out: Path, procs: int, step: int) -> int:
    """Start `procs` ranks, SIGINT the last once rank 0 logs `step`; the step they stopped at."""
    proc = ranks(write_yaml(out.with_suffix(".yaml"), data), out, procs)
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(f"step {step}/"):
            break
    proc.ranks[-1].send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    stopped = read_json(out / "summary.json")
    assert stopped["status"] == "interrupted", stopped
    return stopped["step"]


ASYNC = {"checkpoint_async": True}


# Stopped at the first world size, resumed on 2 (async: full's; GaLore's states: 4 → 2; a
# one-process checkpoint at 2; the same world size, layer-wise). 2 → 1 (full): one process reads
# the shards whole in tests/train/test_multinode.py (2 torchrun nodes stopped, resumed by one
# process, the 1-process losses), so it is not repeated here.
RESUMES: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {  # id -> (W, method, keys)
    "4-2-full-async": (4, FULL, ASYNC), "4-2-galore": (4, GALORE, {}),
    "4-2-adam_mini": (4, {"name": "adam_mini"}, {}), "4-2-apollo": (4, APOLLO, {}),
    "4-2-adam8bit": (4, ADAM8BIT, {}), "4-2-adam4bit": (4, ADAM4BIT, {}),
    "1-2-adam8bit": (1, ADAM8BIT, {}), "2-2-muon-layerwise": (2, MUON, {"layerwise": True}),
}


def test_a_trial_stopped_at_one_world_size_resumes_at_another(tmp_path):
    """Each rank wrote its shards (by parameter name: torch's get_state_dict); a resume at any
    world size reads the rows it now holds (GaLore: its row-sharded moments by rows, its bases
    whole; 8-bit Adam: its absmax values as shards of the blocks; 4-bit AdamW: its quantized
    states in DTensors; Muon's momentum and the layer-wise optimizers' states), one process
    reads them whole, and a one-process checkpoint resumes sharded; the losses after it are the
    uninterrupted 1-process run's. Async: each checkpoint written in the background and
    published once written. Every case stops in one launch of its world size (the last rank
    asks for the stop after step 2, as a SIGINT to it does; the signal itself stops the next
    test's trial) and all resume in one launch of 2."""
    configs = {}
    for case, (_, method, keys) in RESUMES.items():
        data = {**fsdp_run(steps=10, **{k: v for k, v in keys.items() if k != "layerwise"}),
                "method": method, "memory": {"layerwise": True} if keys.get("layerwise") else {}}
        configs[case] = write_yaml(tmp_path / case / "trial.yaml", data)
    for procs in sorted({first for first, *_ in RESUMES.values()}):
        launch([configs[c] for c, (first, *_) in RESUMES.items() if first == procs], procs,
               stop=2)
    for case, path in configs.items():
        stopped = read_json(path.with_suffix("") / "summary.json")
        assert stopped["status"] == "interrupted" and 2 <= stopped["step"] < 10, (case, stopped)
    outputs = launch(list(configs.values()), 2)
    for case, path in configs.items():
        trial = path.with_suffix("")
        assert f"resumed from {trial / 'checkpoint' / 'state.pt'}" in outputs[trial], case
        assert read_json(trial / "summary.json")["step"] == 10, case
        train(load_run(read_yaml(path)), tmp_path / case / "one")
        assert_same_losses(tmp_path / case / "one", trial)
    print(f"fsdp: {', '.join(RESUMES)} stopped and resumed: same losses")


def test_a_sharded_checkpoint_that_does_not_verify_is_skipped_for_the_one_before(tmp_path):
    """Checkpoints at steps 2 and 4, and the stop's (step 4 itself or later): one flipped byte in
    a rank's optimizer file of the newest, found by the rank that reads that byte range (its
    model already read), sets that checkpoint aside (named, with the file and why) on every rank,
    the resume reads the one before, and the losses are still the uninterrupted run's."""
    data = {**fsdp_run(steps=10, checkpoint_every=2), "method": FULL}
    stopped = stop_after(data, tmp_path / "trial", 2, step=4)
    folder = tmp_path / "trial" / "checkpoint"
    shard = folder / "state.pt" / "optimizer" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    output = run_procs(data, tmp_path / "trial", 2)
    assert (f"warning: checkpoint {folder / 'state.pt'} does not load (optimizer/__1_0.distcp: "
            "its sha256 is not the one written)") in output
    # the one before the newest: step 2 or 4, as the stop landed at step 4 or later
    before = re.search(rf"resumed from {folder}/state-\d+\.pt at step (\d+)\n", output)
    assert before and int(before[1]) in (2, 4) and int(before[1]) < stopped, output
    assert read_json(tmp_path / "trial" / "summary.json")["step"] == 10 > stopped
    train(load_run(data), tmp_path / "one")
    assert_same_losses(tmp_path / "one", tmp_path / "trial")


def test_8bit_states_need_shards_of_whole_blocks(monkeypatch):
    """A shard of an 8-bit tensor must be the same whole number of 256-value blocks on every
    rank: 64 x 64 over 4 ranks is 16 x 64 = 4 blocks each; 66 x 64 over 3 is 22 x 64 = 5.5
    blocks, and 2 x 128 over 2 half a block."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Rows.aligned((64, 64), 256)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert not Rows.aligned((66, 64), 256)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not Rows.aligned((2, 128), 256)


def test_what_fsdp_cannot_shard_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^method fira with train\.parallel fsdp: optimizer "
                       r"adam8bit .*use optimizer: adamw"):
        load_run({**fsdp_run(), "method": {**FIRA, "optimizer": "adam8bit"}})
    for setting, why in (({"proj": "svd"}, "use proj: random"),
                         ({"int8_weights": True}, "INT8 codes"),
                         ({"optimizer": "adam8bit"}, "use optimizer: adamw")):
        with pytest.raises(UserError, match=rf"^method apollo with train\.parallel fsdp: .*{why}"):
            load_run({**fsdp_run(), "method": {**APOLLO, **setting}})
    with pytest.raises(UserError, match=r"^method galore with train\.parallel fsdp: optimizer "
                       r"adafactor.*use optimizer: adamw"):
        load_run({**fsdp_run(), "method": {"name": "galore", "optimizer": "adafactor"}})
    with pytest.raises(UserError, match=r"^memory\.optimizer_offload paged with train\.parallel "
                       r"fsdp: .*use optimizer_offload: host"):
        load_run({**fsdp_run(), "memory": {"optimizer_offload": "paged"}})
    with pytest.raises(UserError, match=r"^method qlora with train\.parallel fsdp: .*Params4bit"):
        load_run({**fsdp_run(), "method": {"name": "qlora"}})
    with pytest.raises(UserError, match=r"^train\.precision 16-mixed with train\.parallel "
                       r"fsdp: .*use bf16-mixed"):
        load_run(fsdp_run(precision="16-mixed"))
    assert load_run(fsdp_run()).train.parallel == "fsdp"
    assert load_run(micro_run()).train.parallel == "ddp"
