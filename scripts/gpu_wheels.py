"""The GPU kit's wheels: what the harness needs that the device image lacks (docs/gpu_kit.md).

A lent CUDA machine has no network, Python 3.12 and its own torch, and a call to it carries at
most 64 MiB, the working tree included. This downloads here one cp312 manylinux wheel for each
package the harness needs, transitively (each wheel's Requires-Dist read against
scripts/device_packages.txt, so the set is checked, not guessed), builds the project's own
wheel, and fails if anything stays missing or the kit does not fit. The versions are pinned in
scripts/gpu_kit.lock, so that a kit prepared again is the same one and CI checks it offline
(tests/test_gpu_wheels.py); a package the lock lacks takes the newest that fits, and deleting
the lock takes the newest of every one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
DEVICE_LIST = REPO / "scripts" / "device_packages.txt"
LOCK = REPO / "scripts" / "gpu_kit.lock"
LIMIT = 64 * 2**20  # what one device call may carry, the working tree included
# The harness's own requirements the kit leaves out: imported only where they are used, so
# train, sweep (journal or SQLite storage), bench and estimate run without them
# (tests/test_optional_imports.py).
LEFT_OUT = {"wandb", "psycopg2-binary"}
# The harness's optional extras the kit carries all the same: kernels (liger-kernel, for
# model_options.kernels: liger) runs only on CUDA, with the device's own Triton.
KIT_EXTRAS = {"kernels"}
# Device packages carried all the same: pydantic-core 2.50 needs typing-extensions>=4.16, a
# version the device was not seen to have; newer ones keep the old API, and it weighs 45 kB.
ALSO_CARRY = {"typing-extensions"}
# The device's interpreter, for environment markers (Python 3.12.3 on x86-64 Linux).
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
}
# Oldest first: where a package has several, the wheel that needs the oldest glibc.
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                *(a for p in PLATFORMS for a in ("--platform", p))]


@dataclass
class Wheel:
    """One carried wheel; `requires` holds the Requires-Dist lines that apply on the device."""

    version: str
    file: str
    size: int
    requires: list[str]
    raw: list[str] = field(default_factory=list, repr=False)  # every Requires-Dist line
    extras: set[str] = field(default_factory=set, repr=False)  # extras asked of it


def read_device_list(path: Path = DEVICE_LIST) -> dict[str, Version | None]:
    """The device's packages by canonical name, with the version where one was seen."""
    found: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            found[canonicalize_name(name)] = Version(version) if version else None
    return found


def applying(lines: list[str], extras: set[str]) -> list[str]:
    """The requirement lines that apply on the device when `extras` are asked for."""
    def applies(req: Requirement) -> bool:
        return req.marker is None or any(
            req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in {"", *extras})
    return [line for line in lines if applies(Requirement(line))]


def unmet(needs: list[tuple[str, str]], have: dict[str, Version | None]) -> list[str]:
    """Each (owner, requirement) that no package in `have` satisfies, one line each (a package
    whose version is not known counts as satisfying): empty when nothing is missing."""
    problems = []
    for owner, line in needs:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name not in have:
            problems.append(f"{owner} needs {line}: neither carried nor on the device")
        elif have[name] is not None and not req.specifier.contains(have[name], prereleases=True):
            problems.append(f"{owner} needs {line}: {name} is {have[name]}")
    return problems


def kit_needs(roots: list[str], wheels: dict[str, Wheel]) -> list[tuple[str, str]]:
    """What the harness (`roots`) and each carried wheel require on the device."""
    return [("harness", r) for r in roots] + [
        (name, r) for name, w in sorted(wheels.items()) for r in w.requires]


def kit_roots(requires: list[str]) -> list[str]:
    """The harness's own requirements that apply on the device (KIT_EXTRAS' included), less
    those it leaves out."""
    return [r for r in applying(requires, KIT_EXTRAS)
            if canonicalize_name(Requirement(r).name) not in LEFT_OUT]


def metadata_requires(wheel: Path) -> tuple[str, str, list[str]]:
    """A wheel's name, version and Requires-Dist lines, read from its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(z.read(member).decode())
    return canonicalize_name(meta["Name"]), meta["Version"], meta.get_all("Requires-Dist") or []


def carried(path: Path, extras: set[str]) -> tuple[str, Wheel]:
    name, version, raw = metadata_requires(path)
    return name, Wheel(version, path.name, path.stat().st_size, applying(raw, extras), raw, extras)


def download(specs: list[str], dest: Path) -> list[Path]:
    """One wheel for each spec (no dependencies), into `dest`."""
    with tempfile.TemporaryDirectory() as tmp:
        if subprocess.run([*PIP_DOWNLOAD, "-d", tmp, *specs]).returncode:
            raise SystemExit(f"gpu kit: pip could not download {' '.join(specs)}")
        return [Path(shutil.move(p, dest / p.name)) for p in sorted(Path(tmp).glob("*.whl"))]


def resolve(roots: list[str], device: dict[str, Version | None], pins: dict[str, str],
            dest: Path) -> dict[str, Wheel]:
    """Round by round from `roots`: what the device lacks is downloaded (the pinned version, else
    the newest the first asking requirement allows) and its own requirements followed, until
    nothing new is asked for. One version each: a requirement that the chosen one fails is left
    for `unmet` to name."""
    wheels: dict[str, Wheel] = {}
    while True:
        asked = [*roots, *(r for w in wheels.values() for r in w.requires)]
        fetch: dict[str, Requirement] = {}
        grew = False
        for req in map(Requirement, asked):
            name = canonicalize_name(req.name)
            wheel = wheels.get(name)
            if wheel is not None and not req.extras <= wheel.extras:
                wheel.extras |= req.extras
                wheel.requires = applying(wheel.raw, wheel.extras)
                grew = True
            elif wheel is None and name not in device:
                fetch.setdefault(name, req)
        if not fetch and not grew:
            return wheels
        for name, req in fetch.items():
            if name not in pins:
                print(f"{name}: not pinned, taking the newest for {req}", file=sys.stderr)
        specs = [f"{n}=={pins[n]}" if n in pins else f"{n}{r.specifier}" for n, r in fetch.items()]
        for path in download(specs, dest) if specs else []:
            name, wheel = carried(path, set(fetch[parse_wheel_filename(path.name)[0]].extras))
            wheels[name] = wheel


def tree_files(skip: Path) -> list[Path]:
    """The files a device call carries: tracked and untracked-not-ignored ones (not under
    `skip`, the wheels' folder)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode()
    paths = (REPO / p for p in dict.fromkeys(listed.split("\0")) if p)
    return [p for p in paths if p.is_file() and skip.resolve() not in p.resolve().parents]


def tree_bytes(skip: Path) -> int:
    """The bytes of the files a device call carries (`tree_files`)."""
    return sum(p.stat().st_size for p in tree_files(skip))


def build_project(dest: Path) -> Path:
    """The project's wheel, built from a copy of the tree as a device call carries it (the
    checkout's own build/ folder may hold stale modules)."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in tree_files(dest):
            copy = Path(tmp) / path.relative_to(REPO)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(dest), tmp], check=True)
    return next(dest.glob("harness-*.whl"))


def write_lock(wheels: dict[str, Wheel], path: Path) -> None:
    body = {n: {k: v for k, v in asdict(w).items() if k not in ("raw", "extras")}
            for n, w in sorted(wheels.items())}
    path.write_text(json.dumps({"comment": "written by scripts/gpu_wheels.sh: the GPU kit's "
                                "wheels for Python 3.12 (docs/gpu_kit.md)", "wheels": body},
                               indent=1) + "\n")


def read_lock(path: Path) -> dict[str, Wheel]:
    if not path.exists():
        return {}
    return {n: Wheel(**w) for n, w in json.loads(path.read_text())["wheels"].items()}


def check_here(lock: Path) -> int:
    """On the device, after the install line: every requirement of the harness and of the carried
    wheels met by what this interpreter finds (versions the device list could not say)."""
    have: dict[str, Version | None] = {}
    for dist in metadata.distributions():  # in sys.path order: the one imported comes first
        if dist.metadata["Name"]:
            try:
                version: Version | None = Version(dist.version)
            except InvalidVersion:
                version = None
            have.setdefault(canonicalize_name(dist.metadata["Name"]), version)
    needs = kit_needs(kit_roots(metadata.requires("harness") or []), read_lock(lock))
    problems = unmet(needs, have)
    if problems:
        print("gpu kit incomplete here: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"gpu kit: all {len(needs)} requirements met here")
    return 0


def prepare(dest: Path, lock: Path) -> int:
    """The kit's wheels into `dest`, pinned in `lock`; 1 when incomplete or too large."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: the folder holds this kit alone
        old.unlink()
    project = build_project(dest)
    roots = kit_roots(metadata_requires(project)[2])
    device = read_device_list()
    lacking = {n: v for n, v in device.items() if n not in ALSO_CARRY}
    wheels = resolve(roots, lacking, {n: w.version for n, w in read_lock(lock).items()}, dest)
    write_lock(wheels, lock)
    have = {**device, **{n: Version(w.version) for n, w in wheels.items()}}
    problems = unmet(kit_needs(roots, wheels), have)
    if problems:
        print("gpu kit incomplete: " + "; ".join(problems), file=sys.stderr)
        return 1
    kit = sum(p.stat().st_size for p in dest.glob("*.whl"))
    tree = tree_bytes(dest)
    for name, w in sorted(wheels.items(), key=lambda kv: -kv[1].size):
        print(f"{w.size / 2**20:8.2f} MiB  {name} {w.version}")
    print(f"{project.stat().st_size / 2**20:8.2f} MiB  harness (the project)")
    total = (f"{(kit + tree) / 2**20:.1f} MiB (wheels {kit / 2**20:.1f} + working tree "
             f"{tree / 2**20:.1f})")
    if kit + tree > LIMIT:
        print(f"gpu kit too large: {total} > the 64 MiB a device call carries", file=sys.stderr)
        return 1
    print(f"total {total} of 64 MiB, in {dest}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=REPO / ".whl", type=Path,
                        help="where the wheels go (default .whl)")
    parser.add_argument("--lock", type=Path, default=LOCK, help="the pins, read and written")
    parser.add_argument("--check", action="store_true",
                        help="on the device after the install line: is anything missing?")
    args = parser.parse_args()
    return check_here(args.lock) if args.check else prepare(args.dir, args.lock)


if __name__ == "__main__":
    sys.exit(main())
