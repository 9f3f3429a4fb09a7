"""tests/tiers.py's xdist scheduler and worker count: with 3 workers or more, the first runs the
service groups (Slurm, PostgreSQL, GPU), each whole, and nothing else, while the others run
everything else; with 2, any worker takes any unit, a service group still whole on one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiers import pytest_xdist_auto_num_workers, pytest_xdist_make_scheduler

SERVICE = ["tests/sweep/test_slurm.py::test_array", "tests/sweep/test_slurm.py::test_requeue",
           "tests/sweep/test_postgres.py::test_workers", "tests/gpu/test_gpu.py::test_steps"]
GENERAL = [f"tests/methods/test_lora.py::test_{i}" for i in range(7)]
IDS = SERVICE + GENERAL


class Config:
    """What xdist's scheduler reads of pytest's config: `-n` as its `--tx` list."""

    def __init__(self, workers: int, markexpr: str = "") -> None:
        self.workers = workers
        self.option = SimpleNamespace(loadscopereorder=True, markexpr=markexpr)

    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return [f"{self.workers}*popen"]


class Node:
    """A worker as the scheduler drives it: the indices of the tests it was sent, in order."""

    def __init__(self, name: str) -> None:
        self.name, self.sent, self.done, self.shutting_down = name, [], 0, False
        self.gateway = SimpleNamespace(id=name)  # named when collections are compared

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def start(workers: int) -> tuple[object, list[Node]]:
    sched = pytest_xdist_make_scheduler(Config(workers), None)
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, IDS)
    sched.schedule()
    return sched, nodes


def finish(sched: object, nodes: list[Node]) -> dict[str, list[str]]:
    """Each worker ends its next test in turn until none has one left; who ran what."""
    while any(n.done < len(n.sent) for n in nodes):
        for node in nodes:
            if node.done < len(node.sent):
                sched.mark_test_complete(node, node.sent[node.done])
                node.done += 1
    assert sched.tests_finished and all(n.shutting_down for n in nodes)
    ran = {n.name: [IDS[i] for i in n.sent] for n in nodes}
    assert sorted(t for tests in ran.values() for t in tests) == sorted(IDS)  # each once
    return ran


def groups_whole(ran: dict[str, list[str]]) -> None:
    for group in ("test_slurm.py", "test_postgres.py"):
        assert len([w for w, tests in ran.items() if any(group in t for t in tests)]) == 1


def test_with_three_workers_the_first_runs_the_service_groups_and_nothing_else():
    ran = finish(*start(3))
    assert sorted(ran["gw0"]) == sorted(SERVICE)
    assert ran["gw1"] and ran["gw2"] and sorted(ran["gw1"] + ran["gw2"]) == sorted(GENERAL)


def test_with_two_workers_any_takes_any_unit_and_a_group_stays_whole():
    ran = finish(*start(2))
    groups_whole(ran)
    assert all(set(tests) & set(GENERAL) for tests in ran.values())


def test_a_crashed_service_worker_leaves_its_tests_to_the_others():
    sched, (gw0, *others) = start(3)
    assert IDS[gw0.sent[0]] in SERVICE
    assert sched.remove_node(gw0) == IDS[gw0.sent[0]]  # the test it died in
    ran = finish(sched, others)  # every test once, on the two left
    groups_whole(ran)


@pytest.mark.parametrize(("markexpr", "env", "workers"), [
    ("", None, 3), ("slow and not integration", None, 2), ("", "5", 5)])
def test_auto_is_a_worker_a_core_and_one_for_the_services_unless_none_runs(
        monkeypatch, markexpr, env, workers):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # 2 cores
    if env is None:
        monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", env)
    assert pytest_xdist_auto_num_workers(Config(0, markexpr)) == workers
