#!/usr/bin/env bash
# The GPU kit's wheels, prepared here for a CUDA machine without network (docs/gpu_kit.md):
#   bash scripts/gpu_wheels.sh [DIR]    (default .whl, git-ignored; run in the project's venv)
# DIR then holds one cp312 wheel for each package the harness needs beyond the device image,
# the project's own included; scripts/gpu_kit.lock pins them. Exit 1, one line, when something
# stays missing or the wheels and the working tree exceed the 64 MiB a device call carries.
set -euo pipefail
exec python3 "$(dirname "$0")/gpu_wheels.py" "$@"
