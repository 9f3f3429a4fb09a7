#!/usr/bin/env bash
# A one-node Ray cluster for tests and local sweeps: bash scripts/ray.sh start|stop|status
# `ray start --head` from the active Python environment (its workers run that Python, so start
# it from the venv that has harness[ray]) on 127.0.0.1:$HARNESS_RAY_PORT (default 6380), with
# $HARNESS_RAY_CPUS logical CPUs (default 2), a small object store (trials pass no data through
# it) and its session files in $HARNESS_RAY_DIR (default /tmp/harness-ray). `start` prints the
# address a sweep's launcher.address (or RAY_ADDRESS) takes; it is a no-op if already running.
# `stop` is `ray stop`: it ends every Ray process of this machine's user.
set -euo pipefail

DIR=${HARNESS_RAY_DIR:-/tmp/harness-ray}
PORT=${HARNESS_RAY_PORT:-6380}
CPUS=${HARNESS_RAY_CPUS:-2}
ADDRESS=127.0.0.1:$PORT
# Every address on loopback (Ray would otherwise register the host's first interface address).
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}

command -v ray >/dev/null ||
  { echo "ray.sh: no \`ray\` command: pip install 'harness[ray]' (in the venv trials run in)" >&2; exit 2; }

# The port first: `ray status` on an address where nothing listens retries for 40 s.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }
running() { listening && timeout 60 ray status --address "$ADDRESS" >/dev/null 2>&1; }

start() {
  if running; then
    echo "ray.sh: already running at $ADDRESS" >&2
  else
    mkdir -p "$DIR"
    # 80 MB of object store: Ray's least is 75 MB, and a trial's results are files, not objects.
    ray start --head --node-ip-address=127.0.0.1 --port="$PORT" --num-cpus="$CPUS" --num-gpus=0 \
      --object-store-memory=80000000 --temp-dir="$DIR" --dashboard-host=127.0.0.1 \
      --disable-usage-stats >"$DIR/start.log" 2>&1 ||
      { echo "ray.sh: ray start failed; last lines of $DIR/start.log:" >&2
        tail -n 20 "$DIR/start.log" >&2; exit 1; }
  fi
  echo "$ADDRESS"
}

stop() {
  if running; then
    ray stop >/dev/null 2>&1 && echo "ray.sh: stopped" >&2
  else
    echo "ray.sh: not running" >&2
  fi
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) if running; then echo "running: $ADDRESS"; else echo "stopped"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status   (env: HARNESS_RAY_DIR, HARNESS_RAY_PORT, HARNESS_RAY_CPUS)" >&2
     exit 2 ;;
esac
