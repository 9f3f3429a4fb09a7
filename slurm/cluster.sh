#!/usr/bin/env bash
# A real one-node Slurm 22.05 cluster with accounting, for tests and local sweeps.
#   bash slurm/cluster.sh start|stop|status
# Installs munge, slurmctld, slurmd, slurmdbd and MariaDB with apt when missing and starts them
# by hand as root (no systemd). Config, state, spool, logs and PID files live in one folder:
# $HARNESS_SLURM_DIR (default /tmp/harness-slurm). The Slurm configs are written to /etc/slurm
# so that sinfo/sbatch/sacct and submitit find them without SLURM_CONF. MariaDB listens on
# 127.0.0.1:$HARNESS_SLURM_DB_PORT (default 3306). Accounting makes a crashed job FAILED (not
# UNKNOWN) for submitit; cred_expire=10 and sched_interval=5 make requeued jobs restart in ~15 s.
set -euo pipefail

DIR=${HARNESS_SLURM_DIR:-/tmp/harness-slurm}
DB_PORT=${HARNESS_SLURM_DB_PORT:-3306}
CLUSTER=harness
HOST=$(hostname -s)
DAEMONS=(slurmd slurmctld slurmdbd mariadb munged)   # stop order; start is the reverse

die() { echo "cluster.sh: $*" >&2; exit 1; }
say() { echo "cluster.sh: $*"; }
pid_of() { local f="$DIR/run/$1.pid"; [[ -s $f ]] && cat "$f"; }
alive() { local p; p=$(pid_of "$1") && kill -0 "$p" 2>/dev/null; }

# wait_for <seconds> <what> <log file> <command...>: poll the command, fail with the log's tail.
wait_for() {
  local secs=$1 what=$2 log=$3; shift 3
  for ((i = 0; i < secs * 2; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "cluster.sh: $what did not come up within ${secs}s; last lines of $log:" >&2
  tail -n 25 "$log" >&2 2>/dev/null || true
  exit 1
}

install_missing() {
  local need=()
  command -v munged >/dev/null || need+=(munge)
  command -v slurmctld >/dev/null || need+=(slurmctld)
  command -v slurmd >/dev/null || need+=(slurmd)
  command -v sinfo >/dev/null || need+=(slurm-client)
  command -v slurmdbd >/dev/null || need+=(slurmdbd)
  command -v mariadbd >/dev/null || need+=(mariadb-server)
  ((${#need[@]})) || return 0
  say "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; }
}

write_configs() {
  local cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  # Job ids start from the clock, so a wiped state folder does not reuse ids (submitit's %j folders).
  first_id=$(($(date +%s) / 10 % 50000000 + 1000))
  # A test cluster's clock, not a production one: a requeued job may start again cred_expire + 1
  # seconds after its requeue (5, the least slurmctld accepts; 120 by default, and 10 here
  # before), and the scheduler looks at pending jobs every second instead of every 5. On the
  # 2-core VM, alone: test_preempted_trial_resumes_from_its_checkpoint... 36 s instead of 43.
  mkdir -p /etc/slurm
  cat >/etc/slurm/slurm.conf <<EOF
# Written by slurm/cluster.sh: one-node test cluster; state in $DIR.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((mem_mb / cpus))
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=5
MinJobAge=300
FirstJobId=$first_id
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  cat >/etc/slurm/slurmdbd.conf <<EOF
# Written by slurm/cluster.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 /etc/slurm/slurmdbd.conf
}

start_munge() {
  [[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 "$DIR/munge"
  runuser -u munge -- /usr/sbin/munged --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  wait_for 20 munged "$DIR/munge/munged.log" bash -c 'munge -n | unmunge'
  cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
}

mysql_root() { mariadb --no-defaults -S "$DIR/mysql/mysql.sock" -uroot "$@"; }

start_mariadb() {
  local db=$DIR/mysql
  if [[ ! -d $db/mysql ]]; then
    install -d -o mysql -g mysql "$db"
    mariadb-install-db --no-defaults --datadir="$db" --user=mysql --skip-test-db \
      >"$DIR/log/mariadb-install.log" 2>&1 || { tail "$DIR/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  touch "$DIR/log/mariadb.log" && chown mysql:mysql "$DIR/log/mariadb.log"
  rm -f "$db/mariadb.pid"
  setsid mariadbd --no-defaults --user=mysql --datadir="$db" --socket="$DIR/mysql/mysql.sock" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$db/mariadb.pid" \
    --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
    </dev/null >/dev/null 2>&1 &
  wait_for 60 mariadb "$DIR/log/mariadb.log" bash -c "test -s '$db/mariadb.pid' && mariadb --no-defaults -S '$DIR/mysql/mysql.sock' -uroot -e 'SELECT 1'"
  cp "$db/mariadb.pid" "$DIR/run/mariadb.pid"
  mysql_root -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
}

start() {
  if alive slurmctld && alive slurmd; then say "already running (state in $DIR)"; sinfo; return 0; fi
  local t0=$SECONDS d
  for d in "${DAEMONS[@]}"; do alive "$d" && die "$d is running but the cluster is incomplete; run: $0 stop"; done
  install_missing
  mkdir -p "$DIR"/{run,log,state,spool} && chmod 755 "$DIR"
  write_configs
  start_munge
  start_mariadb
  slurmdbd
  wait_for 60 slurmdbd "$DIR/log/slurmdbd.log" bash -c "test -s '$DIR/run/slurmdbd.pid' && sacctmgr -n show cluster"
  slurmctld
  wait_for 60 slurmctld "$DIR/log/slurmctld.log" scontrol ping
  slurmd
  wait_for 60 "slurmd (node idle)" "$DIR/log/slurmd.log" \
    bash -c "sinfo -h -n '$HOST' -o %t | grep -qx idle"
  wait_for 60 "cluster registration in slurmdbd" "$DIR/log/slurmctld.log" \
    bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER"
  say "up in $((SECONDS - t0)) s: node $HOST, partition debug, state in $DIR"
  sinfo
}

stop() {
  if alive slurmctld; then
    squeue -h -o %u 2>/dev/null | sort -u | xargs -r -n1 scancel --quiet --user 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
  fi
  local d p
  for d in "${DAEMONS[@]}"; do
    p=$(pid_of "$d") || continue
    if kill "$p" 2>/dev/null; then
      for ((i = 0; i < 60; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$p" 2>/dev/null && { say "$d ($p) ignored SIGTERM; killing it"; kill -9 "$p" 2>/dev/null || true; }
      say "stopped $d ($p)"
    fi
    rm -f "$DIR/run/$d.pid"
  done
}

status() {
  local d rc=0
  for d in "${DAEMONS[@]}"; do
    if alive "$d"; then echo "$d: running ($(pid_of "$d"))"; else echo "$d: stopped"; rc=1; fi
  done
  ((rc == 0)) && sinfo && squeue
  return $rc
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status   (state folder: \$HARNESS_SLURM_DIR, default /tmp/harness-slurm)" >&2; exit 2 ;;
esac
