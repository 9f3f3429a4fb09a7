#!/usr/bin/env bash
# A throwaway PostgreSQL 15 server for tests (Optuna RDB storage): bash scripts/postgres.sh start|stop|status
# Runs as the postgres user on 127.0.0.1:$HARNESS_PG_PORT (default 5433) with its data in
# $HARNESS_PG_DIR (default /tmp/harness-pg), without systemd. `start` creates role and database
# `harness` (password `harness`) and prints the SQLAlchemy URL; it is a no-op if already running.
set -euo pipefail

DIR=${HARNESS_PG_DIR:-/tmp/harness-pg}
PORT=${HARNESS_PG_PORT:-5433}
BIN=/usr/lib/postgresql/15/bin
URL="postgresql+psycopg2://harness:harness@127.0.0.1:$PORT/harness"

as_pg() { runuser -u postgres -- "$@"; }

start() {
  if [[ ! -x $BIN/pg_ctl ]]; then
    echo "postgres.sh: installing postgresql-15" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends postgresql-15 >/dev/null ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends postgresql-15 >/dev/null; }
  fi
  if running; then
    echo "postgres.sh: already running in $DIR" >&2
  else
    install -d -o postgres -g postgres -m 700 "$DIR"
    if [[ ! -s $DIR/data/PG_VERSION ]]; then
      as_pg "$BIN/initdb" -D "$DIR/data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 || { tail "$DIR/initdb.log" >&2; exit 1; }
    fi
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/postgres.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c fsync=off" start >/dev/null ||
      { echo "postgres.sh: PostgreSQL did not start; last lines of $DIR/postgres.log:" >&2
        tail -n 20 "$DIR/postgres.log" >&2; exit 1; }
  fi
  as_pg psql -X -q -h "$DIR" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'EOF'
SELECT 'CREATE ROLE harness LOGIN PASSWORD ''harness'''
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'harness')\gexec
SELECT 'CREATE DATABASE harness OWNER harness'
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'harness')\gexec
EOF
  for ((i = 0; i < 60; i++)); do
    PGPASSWORD=harness as_pg pg_isready -q -h 127.0.0.1 -p "$PORT" -d harness -U harness && break
    sleep 0.5
  done
  echo "$URL"
}

stop() {
  if running; then
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null && echo "postgres.sh: stopped" >&2
  else
    echo "postgres.sh: not running" >&2
  fi
}

running() { [[ -d $DIR/data ]] && as_pg "$BIN/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1; }

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) if running; then echo "running: $URL"; else echo "stopped"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status   (env: HARNESS_PG_DIR, HARNESS_PG_PORT)" >&2; exit 2 ;;
esac
