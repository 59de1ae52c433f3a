#!/usr/bin/env bash
# A throw-away one-node Slurm cluster on loopback, for testing `launcher=slurm` (tests/suite/test_slurm.py).
#
#   bash scripts/slurm_cluster.sh install        apt-get the Debian packages (skipped when present)
#   bash scripts/slurm_cluster.sh start [DIR]    start munged, slurmctld and slurmd; config in DIR
#   bash scripts/slurm_cluster.sh status [DIR]   daemons and `sinfo`
#   bash scripts/slurm_cluster.sh stop [DIR]     stop the daemons started by `start`, remove DIR
#
# DIR defaults to /tmp/dopr-slurm. `start` prints `export SLURM_CONF=DIR/slurm.conf`: every Slurm
# command (sbatch, squeue, sinfo, submitit) needs it; `launcher=slurm_local` sizes the jobs for its
# node (docs/suite.md has the command, which tests/suite/test_slurm.py runs). Two partitions share the node: `debug`
# (default, PriorityTier=1) and `urgent` (PriorityTier=10); a job in `urgent` preempts `debug` jobs,
# which get USR2 (submitit checkpoints and requeues them) and are requeued. Runs as root (slurmd
# must). Slurm's ports 6817-6819 are fixed: one such cluster per machine at a time.
set -euo pipefail

CMD=${1:-}
DIR=${2:-/tmp/dopr-slurm}
PACKAGES=(slurmctld slurmd slurm-client munge)
WAIT_S=30

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

# A process is running when it exists and is not a zombie (PID 1 here does not reap: kill -0 lies).
alive() {
  local pid=${1:-} state
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  state=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [[ -n $state && $state != Z && $state != X ]]
}
pid_of() { [[ -f $1 ]] && tr -dc '0-9' <"$1" || true; }

installed() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
              && command -v munged >/dev/null; }

do_install() {
  if installed; then echo "slurm and munge already installed ($(slurmctld -V))"; return 0; fi
  local sudo=()
  if [[ $(id -u) != 0 ]]; then command -v sudo >/dev/null || die "install needs root (or sudo)"; sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
  installed || die "packages installed but slurmctld/slurmd/sbatch/munged not on PATH"
  echo "installed $(slurmctld -V)"
}

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours these: a pinned shell would get a 1-CPU node
  mem=$(free -m | awk '/^Mem:/ {print $2}')
  mem=$(( mem > 2048 ? mem - 1024 : mem * 9 / 10 ))  # a bit under the total: slurmd rejects more
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh: a one-node test cluster on loopback.
ClusterName=dopr-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=cred_expire=5
CryptoType=crypto/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
# GraceTime: a preempted job first gets USR2 (submitit checkpoints and requeues it itself) and is
# killed only after the grace time; without it Slurm requeues the job at once and submitit's own
# \`scontrol requeue\` fails ("Job is pending execution"), which fails the sweep's result.
PartitionName=debug Nodes=$host Default=YES PriorityTier=1 GraceTime=20 MaxTime=INFINITE State=UP
PartitionName=urgent Nodes=$host PriorityTier=10 MaxTime=INFINITE State=UP
EOF
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return 0; fi  # a munged is already serving the default socket: reuse it
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  [[ -s /etc/munge/munge.key ]] || { mungekey --create --force 2>/dev/null || \
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; \
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
  runuser -u munge -- munged --force </dev/null >>"$DIR/log/munged.out" 2>&1
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munged did not start (see /var/log/munge/munged.log)"
  pid_of /run/munge/munged.pid >"$DIR/munged.pid"  # ours: `stop` ends it
}

node_state() { SLURM_CONF=$DIR/slurm.conf timeout 5 sinfo -h -N -o %T 2>/dev/null | head -1 || true; }

do_start() {
  [[ $(id -u) == 0 ]] || die "start must run as root (slurmd does)"
  installed || die "slurm is not installed: run 'bash scripts/slurm_cluster.sh install'"
  if alive "$(pid_of "$DIR/slurmctld.pid")" && alive "$(pid_of "$DIR/slurmd.pid")"; then
    echo "already running (config $DIR/slurm.conf)"
  else
    local other
    other=$(ps -eo pid=,stat=,comm= | awk '($3=="slurmctld" || $3=="slurmd") && $2 !~ /^Z/ {print $1}')
    [[ -z $other ]] || die "another slurmctld/slurmd is running (pids: $(echo $other)); ports 6817-6819 are taken"
    rm -rf "$DIR/state" "$DIR/spool"
    mkdir -p "$DIR/log"
    write_conf
    start_munge
    slurmctld -c -f "$DIR/slurm.conf" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 \
      || die "slurmctld failed: $(tail -5 "$DIR/log/slurmctld.log" 2>/dev/null)"
    slurmd -f "$DIR/slurm.conf" </dev/null >>"$DIR/log/slurmd.out" 2>&1 \
      || die "slurmd failed: $(tail -5 "$DIR/log/slurmd.log" 2>/dev/null)"
  fi
  local state="" t0=$SECONDS
  while (( SECONDS - t0 < WAIT_S )); do
    state=$(node_state)
    [[ $state == idle* || $state == mixed* || $state == allocated* ]] && break
    sleep 0.3
  done
  if [[ $state != idle* && $state != mixed* && $state != allocated* ]]; then
    echo "node not up after ${WAIT_S}s (state '${state:-none}'); logs:" >&2
    tail -n 5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
    exit 1
  fi
  echo "slurm cluster up: node $(hostname -s) $state, partitions debug (default) and urgent"
  echo "export SLURM_CONF=$DIR/slurm.conf"
}

stop_pidfile() {  # TERM, then KILL after ~5 s, the daemon named by a pid file
  local pid
  pid=$(pid_of "$1")
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

do_stop() {
  if [[ -f $DIR/slurm.conf ]]; then  # cancel jobs first so no job step outlives the cluster
    SLURM_CONF=$DIR/slurm.conf timeout 5 scancel --full --quiet --user="$(id -un)" >/dev/null 2>&1 || true
  fi
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/munged.pid"
  if [[ -d $DIR ]]; then  # only what `start` created; DIR itself when that leaves it empty
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/log"
    rm -f "$DIR/slurm.conf" "$DIR/slurmctld.pid" "$DIR/slurmd.pid" "$DIR/munged.pid"
    rmdir "$DIR" 2>/dev/null || true
  fi
  echo "slurm cluster stopped"
}

do_status() {
  local name pid rc=0
  if munge_ok; then echo "munged: running"; else echo "munged: not running"; rc=1; fi
  for name in slurmctld slurmd; do
    pid=$(pid_of "$DIR/$name.pid")
    if alive "$pid"; then echo "$name: running (pid $pid)"; else echo "$name: not running"; rc=1; fi
  done
  if [[ -f $DIR/slurm.conf ]]; then
    echo "export SLURM_CONF=$DIR/slurm.conf"
    SLURM_CONF=$DIR/slurm.conf timeout 5 sinfo 2>&1 || rc=1
  fi
  return $rc
}

case $CMD in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  *) echo "usage: $0 install | start|stop|status [DIR]   (DIR defaults to /tmp/dopr-slurm)" >&2; exit 2 ;;
esac
