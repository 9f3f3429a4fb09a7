"""A pytest plugin (`-p gpu_outcomes`, tests/gpu on the path) that the CUDA kit's tests part
(harness/bench/gpu_parts.py) loads with HARNESS_GPU_RECORDS set: each test's outcome is appended
to that file as soon as it is known. The kit kills a part at its time cap and pytest writes its
own report only at the end: a part cut off at its cap would lose every outcome."""

from __future__ import annotations

import json
import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("HARNESS_GPU_RECORDS")
    if not path or (report.passed and report.when != "call"):
        return  # a passed setup or teardown says nothing of its own
    message = str(report.longrepr).strip().splitlines()[-1][:200] if report.failed else ""
    record = {"name": f"gpu/test/{report.nodeid}", "outcome": report.outcome,
              "when": report.when, "message": message}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
