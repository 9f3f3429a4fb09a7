"""A harness process's exit (harness/__init__.py): the objects it holds are frozen before the
interpreter's teardown, whose collections then skip them, and the rest of a normal exit still
happens: the atexit handlers registered before it run, and a file left open is written out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Registered before `import harness`: atexit runs its handlers last-in first-out, so this one
# runs after the harness's and reads what that left frozen.
REPORT_FROZEN = ("import atexit, gc\n"
                 "atexit.register(lambda: print('frozen', gc.get_freeze_count(), flush=True))\n")


def child(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def frozen_at_exit(imports: str) -> int:
    (line,) = [line for line in child(REPORT_FROZEN + imports).splitlines()
               if line.startswith("frozen ")]
    return int(line.split()[1])


def test_what_a_harness_process_holds_is_frozen_before_its_teardown():
    # A command's imports (the CLI's module imports each command's rooms as it runs: here
    # `harness train`'s config loading) leave about 180,000 objects tracked (torch's alone about
    # 167,000: len(gc.get_objects()) in a fresh interpreter); a child without the harness
    # freezes none.
    assert frozen_at_exit("import harness.cli\nimport harness.methods.resolve\n") > 100_000
    assert frozen_at_exit("import torch\n") == 0


def test_a_file_left_open_is_still_written_at_exit(tmp_path: Path):
    path = tmp_path / "left_open.txt"
    child(f"import harness\nf = open({str(path)!r}, 'w')\nf.write('kept')\n")
    assert path.read_text() == "kept"
