#!/usr/bin/env bash
# The second H200 lease's first call (2026-11-28, evening): the three memory and correctness
# parts of the kit side by side with longer caps than scripts/gpu_lease.sh gives them (on the
# first lease `tests` and `llama7b` were cut off at 4.3 minutes), and probe.py beside them.
# Everything lands in one archive, since a call brings back at most 8 files.
# Usage on the device, after the install line of docs/gpu_kit.md: bash lease.sh OUT
set -u
out=${1:?usage: lease.sh OUT}
work=/tmp/lease && mkdir -p $work
kit() { harness bench gpu --out $work/$1 --parts $1 --cap-min $2 > $work/$1.log 2>&1; }
kit tests 7.8 & kit llama7b 7.8 & kit estimate 5 &
timeout 300 python3 "$(dirname "$0")/probe.py" $work/probe > $work/probe.log 2>&1 &
wait
tar czf $out/lease.tgz -C $work .
tail -n 25 $work/*/gpu.md $work/probe.log | cut -c1-220
