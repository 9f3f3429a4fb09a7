#!/usr/bin/env bash
# The import layers (pyproject's [tool.importlinter]) and zero module cycles, checked on an
# installed copy: methods/ and analysis/ install as harness.methods and harness.analysis
# (package-dir), which an editable install does not lay out as folders for grimp to walk.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d) src=$(mktemp -d)
trap 'rm -rf "$site" "$src"' EXIT
# From a copy of the tracked and new files: a build/ left in the checkout would put modules
# that were moved or deleted since back into the installed copy.
git ls-files -co --exclude-standard -z | tar -c --null -T - | tar -x -C "$src"
pip install -q --no-deps --target "$site" "$src" >/dev/null
cd "$site"  # so that `harness` is the installed copy, not this checkout's folder
PYTHONPATH="$site" lint-imports --config "$OLDPWD/pyproject.toml"
PYTHONPATH="$site" python "$OLDPWD/scripts/module_cycles.py"
