"""The test tiers: which tests carry the `integration` marker (they start processes, use a
service or train a sweep's worth), the service groups each run on one worker, and the check
that a quick test starts no process. conftest.py imports the hooks and the fixture."""

from __future__ import annotations

import math
import multiprocessing.process
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


# -- the integration tier ------------------------------------------------------------------------
# Tests that start processes (the CLI in a child, torchrun, a sweep's trials, Slurm jobs,
# Chromium), use a service, or run a sweep's worth of trainings (a sweep, a benchmark, the
# method x modifier grid) carry the `integration` marker, applied here, so that
# `pytest -m "not integration"` is a quick loop for an edit. A grid keeps some cases quick: a
# test module's `QUICK` maps a test's name to the parameter tuples that stay (the matrix's
# diagonal: every method once, every modifier at least once; the other grids say beside their
# `QUICK` what they keep), the rest of the grid is integration-tier. A test that starts a process
# without the marker fails (`unmarked_processes` below), so these lists cannot fall behind.
INTEGRATION_FILES = {  # every test in these files
    "sweep/test_faults.py", "sweep/test_launchers.py", "sweep/test_postgres.py",
    "sweep/test_run.py", "sweep/test_slurm.py", "sweep/test_study.py", "sweep/test_sweep.py",
    "sweep/test_starter.py", "sweep/test_ray.py",
    "train/test_ddp.py", "train/test_fsdp.py", "test_distributed.py", "analysis/test_html.py",
    "train/test_equality.py",  # ranks forked (tests/ranks.py), many cases a launch
    "trials/test_wandb.py",
    "bench/test_bench.py",  # `harness bench`: many trainings (every method, every config)
    "gpu/test_gpu.py",  # the CUDA checks (`pytest -m gpu`): a grid of trainings and a sweep
    "test_optional_imports.py",  # the CLI in a child without wandb and psycopg2
    "cost/test_sharded.py",  # fsdp ranks, forked (tests/ranks.py)
    "methods/test_sharded_work.py",  # fsdp ranks, forked (tests/ranks.py)
    "bench/test_syncs_ranks.py", "data/test_split_ranks.py",  # ranks forked (tests/ranks.py)
    "test_exit.py",  # a harness process's exit, in a child
    "train/test_peer_faults.py", "train/test_multinode.py",  # torchrun, Slurm-style tasks
}
INTEGRATION_FIXTURES = {"finished_run", "finished_run_copy"}  # a sweep through the CLI
INTEGRATION_TESTS = {  # test names (parameters left out) in other files
    "test_two_processes_train_as_one", "test_two_processes_layerwise_train_as_one",  # torchrun
    "test_two_processes_with_loss_chunk_train_as_one",  # ranks forked (tests/ranks.py)
    "test_hsdp_2x2_trains_as_one_process",  # 4 ranks forked (tests/train/hsdp_cases.py)
    "test_a_trial_stopped_as_2x2_resumes_on_2_processes",  # 4 ranks, then 2
    # a child process exports llama_130m, its memory measured (tests/train/test_stream_export.py)
    "test_a_streamed_exports_host_memory_is_about_one_unit",
    # ranks forked (tests/train/meta_init_ranks.py): meta-device construction, its memory
    "test_sharded_setup_builds_on_meta_and_equals_the_whole_build_bitwise",
    "test_a_ranks_peak_memory_at_start_is_a_quarter_of_one_process_plus_a_constant",
    "test_bench_launch_times_each_launcher", "test_bench_loop_json_pipes_into_a_json_reader",
    "test_user_error_from_the_real_command", "test_llama_7b_in_24gb",
    "test_harness_export_copies_a_finished_trials_model",  # `harness export` in a child
    "test_compiled_step_equals_eager",  # torch.compile runs g++ (tests/methods/test_adam4bit.py)
    "test_harness_export_of_a_folder_that_is_no_trial_is_one_line",
    "test_a_sweep_its_disk_cannot_hold_is_refused_before_its_first_trial",  # a tmpfs, a sweep
    "test_a_second_sweep_on_one_folder_exits_2_and_the_first_finishes_alone",  # two sweeps
    "test_a_full_disk_while_the_model_is_written_keeps_the_checkpoint",  # a tmpfs
    "test_a_run_folder_on_a_disk_this_process_cannot_write_names_that_cause",  # a tmpfs
    "test_the_disk_check_names_an_unwritable_folder_not_its_free_bytes",  # a tmpfs
    "test_llama_7b_on_8_gpus_of_80gb",
    "test_one_command_pretrains_then_fine_tunes_and_reports",
    "test_resume_skips_a_torn_checkpoint_for_the_one_before",
    "test_a_full_disk_while_checkpointing_fails_the_trial_and_keeps_the_previous",
    "test_a_finished_trial_with_torn_checkpoints_trains_again_or_ends_failed",
    "test_a_save_the_disk_cannot_hold_leaves_the_previous_whole",
    "test_a_kill_mid_save_leaves_the_previous_whole",
    "test_a_sharded_checkpoint_is_verified_by_the_ranges_each_rank_reads",  # ranks forked
    "test_wandb_logs_offline_into_the_run_folder",  # wandb's service process
    "test_compile_trains_the_same_model",  # torch.compile runs the C++ compiler
    # tests/train/test_compile.py's trainings: inductor's C++ build
    "test_compiled_losses_equal_eager_within_the_measured_spread",
    "test_compiled_layerwise_updates_keep_their_memory_saving",
    "test_a_compiled_checkpoint_loads_into_an_eager_model_and_back",
    "test_a_second_identical_trial_reads_the_first_ones_compiled_graphs",
    "test_compile_time_is_reported_apart_from_tok_s",
    "test_an_8bit_kernel_is_loaded_before_the_first_step",  # a fresh process
    # `harness bench gpu`: its smoke run and a part killed at its cap
    "test_smoke_runs_every_part_once_and_a_second_run_goes_on_with_what_is_left",
    "test_a_part_past_its_cap_is_killed_and_says_so",
    "test_a_tests_part_cut_off_at_its_cap_keeps_the_outcomes_it_had",
    "test_parts_and_cap_choose_what_runs_and_how_long",
    "test_the_lease_script_runs_its_parts_each_in_its_folder",
    "test_the_mfu_part_times_each_lever_then_the_ones_that_helped_together",  # a benchmark
    "test_bench_report_times_the_report_and_says_met_or_missed",  # `harness report` in a child
    "test_the_script_prepares_the_locked_kit",  # scripts/gpu_wheels.sh through pip
    "test_the_kit_fits_in_one_device_call",  # the project wheel built by pip
    # a benchmark in one test: a sweep's worth of training
    "test_bench_syncs_json", "test_bench_memory_counts_what_it_estimates",
    "test_bench_loop_precision_trains_in_that_precision",
    "test_the_dashboard_shows_the_study_its_trials_and_the_pareto_front",  # a server, Chromium
    "test_the_dashboard_reads_a_postgresql_storage",
    "test_the_dashboard_names_each_objective_by_its_metric",  # a server
    "test_a_bad_model_stops_harness_train_with_one_line",  # `harness train` in a child
    "test_help_and_version_import_neither_torch_nor_transformers",  # a fresh interpreter
    "test_status_reads_a_run_folder_without_importing_torch",  # a fresh interpreter
    "test_internal_lines_reach_the_terminal_only_under_verbose",  # sweeps through the CLI
    "test_exhaustive_cases_wait_for_the_flag",  # pytest's collection in a child
}
QUICK_TOOLS = {"git"}  # run by the code under test in every tier (the commit in config.yaml)


# -- the exhaustive cases -------------------------------------------------------------------------
# A module's `EXHAUSTIVE` maps a test's name to cases whose every path other tests of the suite
# already train (the reason beside each set; `{()}`: the whole of a test without parameters):
# the default run, CI's, leaves them out (listed as deselected), `pytest --exhaustive` runs them
# too. None of them is a `QUICK` case.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the EXHAUSTIVE tests and cases (tests/tiers.py)")


def named_cases(item: pytest.Item, table: str) -> tuple[Any, tuple] | None:
    """(the cases its module's `table` names for this test, this item's parameter tuple: () for
    a test of one case) for a test with such an entry; None for any other test."""
    named = getattr(item.module, table, {}).get(item.originalname)
    if named is None:
        return None
    callspec = getattr(item, "callspec", None)
    return named, tuple(callspec.params.values()) if callspec else ()


def is_exhaustive(item: pytest.Item) -> bool:
    case = named_cases(item, "EXHAUSTIVE")
    return case is not None and case[1] in case[0]


def is_integration(item: pytest.Item) -> bool:
    file = item.path.relative_to(REPO / "tests").as_posix()
    name = item.originalname
    case = named_cases(item, "QUICK")
    if case is not None:  # a grid: the cases its QUICK keeps stay quick
        return case[1] not in case[0]
    return (file in INTEGRATION_FILES or name in INTEGRATION_TESTS
            or bool(INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))))


# One service, one test at a time: each group runs on one worker (ServiceGroups below), so two
# sweeps never compete for the one Slurm node's CPUs or the same database, and no GPU check
# shares the device (an over-budget batch fills it before it fails).
SERVICE_GROUPS = {"sweep/test_slurm.py": "slurm", "sweep/test_postgres.py": "postgres",
                  "sweep/test_ray.py": "ray", "gpu/test_gpu.py": "gpu"}


def service_group(nodeid: str) -> str | None:
    return SERVICE_GROUPS.get(nodeid.split("::", 1)[0].removeprefix("tests/"))


# Files whose tests share a module-scoped fixture that trains (ranks launched, a compile, a
# pair of runs): each file runs on one worker, so the fixture is built once, not on each.
SHARED_SETUP_FILES = {
    "train/test_compile.py", "train/test_hsdp.py", "cost/test_tensor_peak.py",
    "methods/test_lora.py", "methods/test_qlora.py", "methods/test_relora.py",
    "methods/test_relora_reference.py", "train/test_multinode.py",
    "eval/test_eval.py",  # lm-eval's task index, built once a process, and one scoring
}


# Grids whose cases compare with their method's plain run, trained once a process
# (tests/method_matrix.py's `baseline`): a method's cases run on one worker, so its plain run
# is trained once, not once a worker. Their case ids start with the method's name and a "-".
PER_METHOD_GRIDS = {"tests/modifiers/test_modifiers.py::test_every_method_with_every_modifier"}


def worker_scope(nodeid: str) -> str:
    """What one worker runs together: a service group, a shared-setup file, a method's cases of
    a per-method grid, else the test."""
    file = nodeid.split("::", 1)[0]
    shared = file.removeprefix("tests/") in SHARED_SETUP_FILES
    test, _, case = nodeid.partition("[")
    if test in PER_METHOD_GRIDS:
        return f"{test}[{case.split('-', 1)[0]}"
    return service_group(nodeid) or (file if shared else nodeid)


def check_named(items: list[pytest.Item], table: str) -> None:
    """A `QUICK` (or `EXHAUSTIVE`) case that names no case of its grid would leave the grid out
    of the quick tier (or in CI's run) unseen: where a grid's every case was collected, each
    case the table names must be one; an exhaustive case is never a quick one."""
    grids: dict[tuple[str, str], tuple[Any, int, list[tuple]]] = {}
    for item in items:
        case = named_cases(item, table)
        if case is not None:
            cases = math.prod(len(m.args[1]) for m in item.iter_markers("parametrize"))
            key = (item.module.__name__, item.originalname)
            grids.setdefault(key, (case[0], cases, []))[2].append(case[1])
            quick = named_cases(item, "QUICK")
            if table == "EXHAUSTIVE" and quick and case[1] in case[0] and case[1] in quick[0]:
                raise pytest.UsageError(f"{key[0]}.EXHAUSTIVE[{key[1]!r}] names {case[1]!r}, a "
                                        "QUICK case; the quick tier keeps it")
    for (module, name), (named, cases, seen) in grids.items():
        stale = [case for case in named if case not in seen]
        if len(seen) == cases and stale:
            raise pytest.UsageError(f"{module}.{table}[{name!r}] names {stale[0]!r}, which is "
                                    f"no case of the grid; name a case that it parametrizes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_named(items, "QUICK")
    check_named(items, "EXHAUSTIVE")
    if not config.getoption("exhaustive"):
        left_out = [item for item in items if is_exhaustive(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not is_exhaustive(item)]
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)
    # The service groups first: each runs on one worker, one test after another (Slurm's ~7
    # minutes, much of it waiting on the scheduler), so started first they overlap the rest of
    # the suite instead of being its tail (collected last, they added ~5 minutes to CI's wall).
    # Then the other integration tests (seconds to two minutes each), the quick ones (most under
    # a second) last: the workers run out of tests within a short one of each other, not with
    # one idle while the other ends a fine-tune or the kit's smoke run (stable: each tier in
    # its collection order).
    items.sort(key=lambda item: (service_group(item.nodeid) is None,
                                 not item.get_closest_marker("integration")))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`'s rule, decided here by file: xdist 3.8 marks a group by rewriting
    `item._nodeid`, which pytest 9 no longer reads (nodeid comes from `_id`), so its groups were
    silently split over workers. A service or shared-setup file is one scope; every other test
    its own (`worker_scope`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ServiceGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ServiceGroups(config, log)


@pytest.fixture(autouse=True)
def unmarked_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fails a test outside the integration tier that starts a process."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    started: list[str] = []
    start = subprocess.Popen.__init__

    def watched(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, str | os.PathLike) else list(args)
        if Path(str(argv[0]).split()[0]).name not in QUICK_TOOLS:
            started.append(" ".join(map(str, argv))[:120])
        start(self, args, *rest, **kw)

    begin = multiprocessing.process.BaseProcess.start

    def forked(self: multiprocessing.process.BaseProcess) -> None:  # the fork server's starts
        started.append(f"{self.name}: a multiprocessing process")
        begin(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", forked)
    yield
    if started:
        pytest.fail(f"started a process ({started[0]}) without the integration marker: "
                    "add the test to INTEGRATION_TESTS in tests/tiers.py")
