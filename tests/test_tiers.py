"""tests/tiers.py's scheduling and selection: a file whose tests share a module-scoped fixture
runs on one worker, so that fixture is built once a run, not once a worker (and a method's cases
of the matrix, its plain run); a grid's EXHAUSTIVE cases wait for `pytest --exhaustive`."""

from __future__ import annotations

import ast
import subprocess
import sys

from tiers import REPO, SHARED_SETUP_FILES, worker_scope


def shared_fixture_uses(path: str) -> dict[str, int]:
    """Each module-scoped fixture of the file: the test cases that ask for it (a parametrized
    test's cases counted by its parameter lists' lengths)."""
    tree = ast.parse((REPO / "tests" / path).read_text())
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    shared = {f.name for f in functions for d in f.decorator_list
              if "scope='module'" in ast.unparse(d)}
    uses = dict.fromkeys(shared, 0)
    for f in functions:
        if f.name.startswith("test_"):
            cases = 1
            for d in f.decorator_list:
                if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize"):
                    values = d.args[1]
                    cases *= len(values.elts) if isinstance(values, ast.List | ast.Tuple) else 2
            for arg in f.args.args:
                if arg.arg in uses:
                    uses[arg.arg] += cases
    return uses


def test_each_shared_setup_file_has_a_fixture_that_two_tests_share():
    for path in sorted(SHARED_SETUP_FILES):
        assert max(shared_fixture_uses(path).values(), default=0) >= 2, path


def test_a_shared_setup_file_is_one_scope_and_other_tests_their_own():
    compile_ = [f"tests/train/test_compile.py::{name}" for name in ("test_a", "test_b[x]")]
    assert worker_scope(compile_[0]) == worker_scope(compile_[1]) == "tests/train/test_compile.py"
    other = ["tests/train/test_train.py::test_a", "tests/train/test_train.py::test_b"]
    assert worker_scope(other[0]) != worker_scope(other[1])
    assert worker_scope("tests/sweep/test_slurm.py::test_a") == "slurm"


def test_a_methods_cases_of_the_matrix_are_one_scope():
    """Its plain run is trained once a process: the method's cases share a worker."""
    grid = "tests/modifiers/test_modifiers.py::test_every_method_with_every_modifier"
    galore = [f"{grid}[galore-{x}]" for x in ("layerwise", "16-mixed", "bf16_true_kahan")]
    assert len({worker_scope(n) for n in galore}) == 1
    assert worker_scope(f"{grid}[galore-layerwise]") != worker_scope(f"{grid}[lora-layerwise]")
    assert worker_scope(f"{grid}[apollo-layerwise]") != worker_scope(
        f"{grid}[apollo_mini-layerwise]")


def collected(*argv: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0",
                          "-p", "no:cacheprovider", "tests/modifiers/test_bf16_true.py",
                          "tests/sweep/test_postgres.py", *argv],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "::" in line}


def test_exhaustive_cases_wait_for_the_flag():
    """`pytest` leaves a grid's EXHAUSTIVE cases out, and a test EXHAUSTIVE names whole (`{()}`),
    and `pytest --exhaustive` collects them."""
    test = "tests/modifiers/test_bf16_true.py::test_every_method_trains_under_bf16_true"
    whole = "tests/sweep/test_postgres.py::test_two_workers_share_one_study_without_duplicates"
    default, every = collected(), collected("--exhaustive")
    left_out = every - default
    assert left_out and all(n.startswith(test) for n in left_out - {whole})
    assert {f"{test}[lion]", f"{test}[galore]", whole} <= left_out
    assert {f"{test}[full]", f"{test}[schedule_free]"} <= default
    assert "tests/sweep/test_postgres.py::test_eight_workers_run_48_trials_once_though_one_is_" \
        "killed" in default
