#!/bin/bash
# A real 2-node SLURM cluster on this one machine, for trying examples/slurm/dynamic_avg.sbatch
# (and its preemption/requeue path) without a cluster.
#
#   examples/slurm/local_cluster.sh start    # install slurm-wlm + munge if absent, start, wait for idle nodes
#   eval "$(examples/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/srun/sinfo/scontrol, MASTER_ADDR
#   examples/slurm/local_cluster.sh status
#   examples/slurm/local_cluster.sh stop     # stop the daemons it started (state dir kept)
#   examples/slurm/local_cluster.sh clean    # stop and delete the state dir
#
# One slurmctld plus one `slurmd -N nodeK` per node, each slurmd on its own port
# (NodeName=nodeK NodeHostname=localhost Port=...), and a private munged. Everything (config,
# munge key and socket, spool, logs, pid files) lives under $LD_SLURM_DIR (default /tmp/ld-slurm),
# so it touches no system daemon and needs no systemd. The config is the simplest that runs in
# a container without cgroups: proctrack/linuxproc, task/none, no accounting database
# (job completions, requeues included, go to $LD_SLURM_DIR/log/jobcomp.log instead of sacct).
# Everything runs as root (SlurmUser=root). Tested with Debian 12's slurm-wlm 22.05.8.
#
# Settings (environment): LD_SLURM_DIR, LD_SLURM_NODES (2), LD_SLURM_CPUS (CPUs per node,
# default: the machine's cores divided among the nodes, at least 1), LD_SLURM_PORT (first port,
# 6917: slurmctld; the nodes take the next ones).
set -euo pipefail

STATE=${LD_SLURM_DIR:-/tmp/ld-slurm}
NODES=${LD_SLURM_NODES:-2}
CPUS=${LD_SLURM_CPUS:-$(( $(nproc) / NODES > 0 ? $(nproc) / NODES : 1 ))}
PORT=${LD_SLURM_PORT:-6917}
CONF=$STATE/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

install_if_absent() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return
  [ "$(id -u)" = 0 ] || die "slurm-wlm/munge are missing and installing them needs root"
  echo "installing Debian's slurm-wlm and munge"
  apt-get update -q
  # policy-rc.d in containers (or no systemd) keeps the packages' own services from starting;
  # this script starts its own daemons either way.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
}

write_config() {
  mkdir -p "$STATE"/{munge,ctld,spool,log,run}
  chmod 700 "$STATE/munge"
  [ -s "$STATE/munge/munge.key" ] || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/munge/munge.key"
  local k
  {
    cat <<EOF
# Written by examples/slurm/local_cluster.sh: $NODES nodes on this machine.
ClusterName=ldslurm
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
MailProg=/bin/true
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (SLURM's default: 120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=30
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
JobRequeue=1
ReturnToService=2
# Keep finished jobs in scontrol for an hour (Restarts=, the requeue count), kill fast on cancel.
MinJobAge=3600
KillWait=15
SlurmdTimeout=60
InactiveLimit=0
EOF
    for k in $(seq 1 "$NODES"); do
      echo "NodeName=node$k NodeHostname=localhost Port=$((PORT + k)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Start a daemon without the descriptors this script inherited beyond stdin/out/err: a daemon
# holding, say, the lock file of `flock LOCK make slurm-demo` would keep that lock until stopped.
daemon() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -le 2 ] || eval "exec $fd>&-"
    done
    exec "$@"
  )
}

start() {
  install_if_absent
  if pid_alive "$STATE/run/slurmctld.pid"; then
    echo "already running (stop it first to rewrite the config)"
  else
    write_config
    pid_alive "$STATE/run/munged.pid" || daemon munged --force --socket="$MUNGE_SOCKET" \
      --key-file="$STATE/munge/munge.key" --pid-file="$STATE/run/munged.pid" \
      --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"
    # -c: forget jobs of an earlier start; -i: ignore stale state files.
    daemon slurmctld -c -i -f "$CONF"
    for k in $(seq 1 "$NODES"); do
      daemon slurmd -N "node$k" -f "$CONF"
    done
  fi
  export SLURM_CONF=$CONF
  local deadline=$((SECONDS + 60))
  until [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -ge "$NODES" ]; do
    [ $SECONDS -lt $deadline ] || { sinfo -N 2>&1 || true; tail -n 20 "$STATE"/log/*.log; die "nodes not idle after 60 s"; }
    sleep 1
  done
  sinfo -N
  echo "cluster up; use it with: eval \"\$($0 env)\""
}

stop() {
  local f pid
  for f in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid" "$STATE/run/munged.pid"; do
    if pid_alive "$f"; then
      pid=$(cat "$f")
      kill "$pid"
      # Wait for it to exit so a following start can bind the same ports.
      for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "$f"
  done
  echo "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  clean) stop; rm -rf "$STATE" ;;
  status) SLURM_CONF=$CONF sinfo -N; SLURM_CONF=$CONF squeue ;;
  # The node names are no host names here: Lightning would take node1 as the rendezvous address.
  env) echo "export SLURM_CONF=$CONF MASTER_ADDR=127.0.0.1" ;;
  *) die "usage: $0 start|stop|clean|status|env" ;;
esac
