#!/bin/bash
# `make slurm-demo`: the sbatch example on a local 2-node SLURM cluster, once straight through and
# once preempted. Starts the cluster (examples/slurm/local_cluster.sh), submits
# examples/slurm/dynamic_avg.sbatch on CPU, then submits it again and, once the first checkpoint
# is written, sends the requeue signal the way SLURM does before a time limit (SIGUSR1 to every
# task: `scancel -s USR1`). Lightning's auto-requeue writes the hpc checkpoint and requeues the job,
# which restarts under the same id and resumes from it. Then submits it on 2 nodes x 2 tasks with
# `--hierarchy node` (one learner per node: DDP between a node's two tasks, dynamic averaging between
# the nodes). Prints the evidence and stops the cluster.
# Settings (environment): TRAIN_ARGS (train.py arguments; default a run of about a minute on 2 CPU
# cores), PYTHON (default .venv/bin/python), LD_SLURM_* (see local_cluster.sh).
# Recorded run (2 CPU cores, 148 s in all): job 3 straight through, COMPLETED in 52 s at global_step
# 10000; job 4 signalled 17 s after submission, hpc checkpoint and requeue at global_step 1509,
# pending 32 s, restarted (Restarts=1), "training from global_step 1509", COMPLETED at 10000.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/slurm
TRAIN_ARGS=${TRAIN_ARGS:---epochs 40 --checkpoint-every 1000}
export PYTHON=${PYTHON:-$PWD/.venv/bin/python}
STATE=${LD_SLURM_DIR:-/tmp/ld-slurm}
# Two CPUs per node, so that part 3's two tasks per node fit (on a 2-core machine they share the cores).
export LD_SLURM_CPUS=${LD_SLURM_CPUS:-2}
JOBS=$STATE/jobs
# Job ids start again at 1 on a new cluster: keep this demo's runs apart from any earlier ones.
export RUN_ROOT=$STATE/runs
rm -rf "$RUN_ROOT"

submitted=()
cleanup() {
  [ ${#submitted[@]} -eq 0 ] || scancel "${submitted[@]}" 2>/dev/null || true
  "$HERE/local_cluster.sh" stop
}
trap cleanup EXIT
"$HERE/local_cluster.sh" start
eval "$("$HERE/local_cluster.sh" env)"
mkdir -p "$JOBS"

job_state() { scontrol show job "$1" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }

# Wait until job $1 is in a final state (the requeue passes through REQUEUED and PENDING).
wait_done() {
  local deadline=$((SECONDS + 900))
  until [[ "$(job_state "$1")" =~ ^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)$ ]]; do
    [ $SECONDS -lt $deadline ] || { echo "job $1 not done after 900 s" >&2; return 1; }
    sleep 1
  done
}

submit() {  # sbatch options, if any, before the script; TRAIN_ARGS and "$@" after it go to train.py
  local options=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do options+=("$1"); shift; done
  if [ $# -gt 0 ]; then shift; fi
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
  sbatch --parsable --output="$JOBS/%x-%j.out" "${options[@]}" "$HERE/dynamic_avg.sbatch" $TRAIN_ARGS "$@"
}

evidence() {
  echo "--- job $1: scontrol"
  scontrol show job "$1" | grep -E -o '(JobId|JobState|Requeue|Restarts|ExitCode|RunTime|NodeList)=[^ ]*' | tr '\n' ' '
  echo
  echo "--- job $1: job completion log ($STATE/log/jobcomp.log)"
  grep "JobId=$1 " "$STATE/log/jobcomp.log" | grep -E -o '(JobId|JobState|StartTime|EndTime|NodeList|ExitCode)=[^ ]*' | paste -sd' ' | fold -w 160 || true
  echo "--- job $1: output ($JOBS/lightning-dist-$1.out)"
  grep -E "training from|requeue|Requeu|Restored|finished|learner|Error|error" "$JOBS/lightning-dist-$1.out" || true
}

echo "=== 1. straight through: sbatch $HERE/dynamic_avg.sbatch $TRAIN_ARGS"
start=$SECONDS
plain=$(submit)
submitted+=("$plain")
wait_done "$plain"
echo "job $plain done in $((SECONDS - start)) s"
evidence "$plain"

echo "=== 2. preempted: the same, with scancel -s USR1 once the first checkpoint exists"
start=$SECONDS
job=$(submit)
submitted+=("$job")
until [ -f "$RUN_ROOT/slurm-$job/checkpoints/last.ckpt" ]; do
  [ "$(job_state "$job")" = RUNNING ] || [ "$(job_state "$job")" = PENDING ] || { echo "job $job ended before its first checkpoint" >&2; exit 1; }
  sleep 1
done
sleep 3
echo "first checkpoint written; scancel -s USR1 $job after $((SECONDS - start)) s"
scancel -s USR1 "$job"
wait_done "$job"
echo "job $job done in $((SECONDS - start)) s (submission to end, requeue included)"
evidence "$job"
ls "$RUN_ROOT/slurm-$job"

echo "=== 3. one learner per node: sbatch --ntasks-per-node=2 $HERE/dynamic_avg.sbatch $TRAIN_ARGS --hierarchy node"
start=$SECONDS
nodes=$(submit --ntasks-per-node=2 -- --hierarchy node)
submitted+=("$nodes")
wait_done "$nodes"
echo "job $nodes done in $((SECONDS - start)) s"
evidence "$nodes"
for id in "$plain" "$job" "$nodes"; do [ "$(job_state "$id")" = COMPLETED ] || exit 1; done
