#!/usr/bin/env bash
# The CUDA kit in one device command of under 10 minutes, for a 15-minute lease (the kit's own
# caps, 42 minutes in all, were sized for 30): 9 minutes at SCALE 1. The four parts whose
# figures are memory and correctness run side by side, each in its own folder (a process's
# allocator statistics are its own; the oom test's batch may briefly take the GPU's free
# memory, so a concurrent run can end `oom` and says so; table11's tok/s are then not
# comparisons, its peaks are); then `mfu`, the timed part, alone. `loop` is left for a
# second call. Usage, on the device, after the install line of docs/gpu_kit.md:
# bash scripts/gpu_lease.sh DIR [SCALE]
# SCALE (default 1) multiplies every cap; CI runs it with --smoke via GPU_LEASE_SMOKE=1.
set -u
dir=${1:?usage: gpu_lease.sh DIR [SCALE]}
scale=${2:-1}
smoke=${GPU_LEASE_SMOKE:+--smoke}
cap() { python3 -c "print($1 * $scale)"; }
kit() { harness bench gpu --out "$dir/$1" --parts "$1" --cap-min "$(cap "$2")" $smoke; }

kit tests 4.5 & kit estimate 4.5 & kit table11 4.5 & kit llama7b 5.5 &  # 7B: its SVDs
wait
kit mfu 3.5
