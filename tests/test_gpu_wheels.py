"""The GPU kit (docs/gpu_kit.md): the wheels pinned in scripts/gpu_kit.lock, installed with
--no-deps beside the device's own packages (scripts/device_packages.txt), leave nothing the
harness needs missing, carry no torch, and fit with the working tree in one device call.
Offline: the lock holds each wheel's requirements; the last test prepares the kit for real."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import tomllib
from conftest import REPO
from packaging.version import Version


def load_script() -> ModuleType:
    """scripts/gpu_wheels.py, which no package holds."""
    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "scripts" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


kit = load_script()


def declared() -> list[str]:
    """pyproject's requirements as the project wheel's METADATA writes them, extras marked."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(f'{r}; extra == "{extra}"' for extra, reqs in
                                        project["optional-dependencies"].items() for r in reqs)]


def test_the_locked_kit_leaves_nothing_missing():
    device, wheels = kit.read_device_list(), kit.read_lock(kit.LOCK)
    roots = kit.kit_roots(declared())
    have = {**device, **{n: Version(w.version) for n, w in wheels.items()}}
    assert kit.unmet(kit.kit_needs(roots, wheels), have) == []


def test_the_kit_carries_liger_for_the_kernels_option_and_no_other_extra():
    """model_options.kernels: liger on the device: liger-kernel carried, its Triton the
    device's own; the test and dashboard extras stay out."""
    roots = kit.kit_roots(declared())
    assert 'liger-kernel>=0.8; extra == "kernels"' in roots
    assert not any("extra ==" in r and "kernels" not in r for r in roots)
    wheels, device = kit.read_lock(kit.LOCK), kit.read_device_list()
    assert "triton>=2.3.1" in wheels["liger-kernel"].requires and "triton" not in wheels
    assert device["triton"] == Version("3.6.0")


def test_the_kit_carries_no_torch_and_nothing_else_the_device_has():
    device, wheels = kit.read_device_list(), kit.read_lock(kit.LOCK)
    assert device["torch"] == Version("2.11.0")
    assert "torch" not in wheels
    assert set(wheels) & set(device) == kit.ALSO_CARRY


def test_the_kit_fits_in_one_device_call(tmp_path):
    """The locked wheels, the project's wheel built as the script builds it (its files
    compressed, as a device call carries it) and the working tree, under the call's limit."""
    wheels = sum(w.size for w in kit.read_lock(kit.LOCK).values())
    project = kit.build_project(tmp_path).stat().st_size
    tree = kit.tree_bytes(REPO / ".whl")
    assert wheels + project + tree < kit.LIMIT, f"{(wheels + project + tree) / 2**20:.1f} MiB"


def test_only_requirements_that_apply_on_the_device_count():
    lines = ["numpy>=1.17", 'colorama; sys_platform == "win32"', 'pytest; extra == "test"',
             'aiohttp; extra == "http"', 'tomli; python_version < "3.11"']
    assert kit.applying(lines, set()) == ["numpy>=1.17"]
    assert kit.applying(lines, {"http"}) == ["numpy>=1.17", 'aiohttp; extra == "http"']


def test_unmet_names_what_is_missing_or_too_old():
    have = {"numpy": Version("2.5.2"), "pyarrow": None}
    needs = [("a", "numpy>=2"), ("b", "numpy<2"), ("c", "pyarrow>=99"), ("d", "greenlet")]
    assert kit.unmet(needs, have) == [
        "b needs numpy<2: numpy is 2.5.2",
        "d needs greenlet: neither carried nor on the device",
    ]


def test_the_script_prepares_the_locked_kit(tmp_path):
    """Through the package index: the same wheels as the lock pins (the lock is current), and
    every requirement in their own METADATA met by the kit or the device."""
    lock = Path(shutil.copy(kit.LOCK, tmp_path / "gpu_kit.lock"))
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(tmp_path / "whl"),
                           "--lock", str(lock)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert lock.read_text() == kit.LOCK.read_text()
    found = {}
    for path in (tmp_path / "whl").glob("*.whl"):
        name, version, requires = kit.metadata_requires(path)
        found[name] = (version, requires if name == "harness" else kit.applying(requires, set()))
    assert {n: v for n, (v, _) in found.items() if n != "harness"} == {
        n: w.version for n, w in kit.read_lock(kit.LOCK).items()}
    needs = [("harness", r) for r in kit.kit_roots(found.pop("harness")[1])]
    needs += [(n, r) for n, (_, requires) in found.items() for r in requires]
    have = {**kit.read_device_list(), **{n: Version(v) for n, (v, _) in found.items()}}
    assert kit.unmet(needs, have) == []
