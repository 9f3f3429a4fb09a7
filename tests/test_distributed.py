"""harness/distributed/ in one process: the environment decides rank and world before a group
exists, rank > 0 writes nothing, and the helpers run (or are no-ops) on a real 1-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import distributed
from harness.errors import UserError


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.active()


def test_without_torchrun_everything_is_one_process(no_torchrun, capsys):
    assert (distributed.world_size(), distributed.rank(), distributed.local_rank()) == (1, 0, 0)
    assert distributed.is_main()
    distributed.say("from rank", 0)
    assert capsys.readouterr().out == "from rank 0\n"
    cpu = torch.device("cpu")
    assert distributed.init(cpu) == cpu and not distributed.active()  # joins nothing
    t = torch.tensor([1.0, 2.0])
    assert distributed.all_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert distributed.any_rank(True, cpu) is True and distributed.any_rank(False, cpu) is False
    model = nn.Linear(2, 2)
    assert distributed.wrap(model, cpu, layerwise=False) is model
    distributed.check_same(model, 1)
    distributed.barrier()
    distributed.teardown()


def test_rank_and_world_come_from_the_environment_before_a_group(no_torchrun, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("RANK", "3")
    assert distributed.rank() == 0  # a lone RANK without WORLD_SIZE > 1 is no data parallelism
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (distributed.world_size(), distributed.rank(), distributed.local_rank()) == (4, 3, 1)
    assert not distributed.is_main()
    distributed.say("hidden")
    assert capsys.readouterr().out == ""


class FakeRecords:
    """Stands for Records: one read, one write."""

    def __init__(self):
        self.written: list[str] = []
        self.folder = "trial"

    def summary(self):
        return {"status": "ok"}

    def log(self, line: str) -> str:
        self.written.append(line)
        return "logged"


def test_main_only_keeps_reads_and_drops_writes_on_other_ranks(no_torchrun, monkeypatch):
    records = FakeRecords()
    assert distributed.main_only(records) is records
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    view = distributed.main_only(records)
    assert isinstance(view, distributed.MainOnly)
    assert view.summary() == {"status": "ok"} and view.folder == "trial"
    assert view.log("x") is None and records.written == []


def test_pick_device():
    assert distributed.pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert distributed.pick_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="device: 'cuda' asked for but no CUDA device"):
            distributed.pick_device("cuda")


def test_helpers_on_a_real_one_rank_gloo_group(no_torchrun, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert distributed.active() and distributed.world_size() == 1 and distributed.rank() == 0
        t = torch.tensor([1.5, -2.0])
        assert distributed.all_sum(t).tolist() == [1.5, -2.0]
        cpu = torch.device("cpu")
        assert distributed.any_rank(True, cpu) and not distributed.any_rank(False, cpu)
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        before = [p.detach().clone() for p in model.parameters()]
        assert distributed.wrap(model, cpu, layerwise=True) is model  # broadcast, not wrapped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        ddp = distributed.wrap(model, cpu, layerwise=False)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
        ddp(torch.ones(4, 3)).sum().backward()
        assert model.weight.grad is not None
        distributed.check_same(model, 1)
        distributed.barrier()
        assert distributed.trainable(model) == [id(model.weight), id(model.bias)]
        model.bias.requires_grad_(False)
        assert distributed.trainable(model) == [id(model.weight)]
    finally:
        distributed.teardown()
    assert not distributed.active()
