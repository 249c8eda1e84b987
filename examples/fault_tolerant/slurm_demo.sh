#!/bin/bash
# examples/fault_tolerant/diloco.sbatch on a local 3-node SLURM cluster (examples/slurm/local_cluster.sh; root,
# Debian: installs slurm-wlm and munge when absent): submits it, cancels group 2's job step with SIGKILL once every
# group has ended a window (as a node's crash would end it), lets the sbatch start it again, and prints what each
# group's log says (the quorums, discarded windows, the end). Stops the cluster.
# Settings (environment): MAX_STEPS (20000: long enough that the restarted group rejoins the others), KILL_AFTER
# (seconds after every group's first window, 10), PYTHON (default .venv/bin/python), LD_SLURM_* (local_cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON=${PYTHON:-$PWD/.venv/bin/python}
export LD_SLURM_NODES=${LD_SLURM_NODES:-3}
STATE=${LD_SLURM_DIR:-/tmp/ld-slurm}
export RUN_ROOT=$STATE/runs
MAX_STEPS=${MAX_STEPS:-20000}
KILL_AFTER=${KILL_AFTER:-10}
mkdir -p "$STATE/jobs"

job=
cleanup() {
  [ -z "$job" ] || scancel "$job" 2>/dev/null || true
  examples/slurm/local_cluster.sh stop
}
trap cleanup EXIT
examples/slurm/local_cluster.sh start
eval "$(examples/slurm/local_cluster.sh env)"

started=$SECONDS
job=$(sbatch --parsable --output="$STATE/jobs/%x-%j.out" examples/fault_tolerant/diloco.sbatch \
  --trainer.max_steps="$MAX_STEPS")
logs=$RUN_ROOT/ft-$job
echo "job $job submitted; logs in $logs"
state() { scontrol show job "$job" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
first_window() { [ -f "$logs/group$1-0.log" ] && grep -q "lightning_dist: quorum" "$logs/group$1-0.log"; }
until first_window 0 && first_window 1 && first_window 2; do
  [[ "$(state)" =~ ^(PENDING|RUNNING)$ ]] || { echo "job $job ended before every group's first window" >&2; exit 1; }
  [ $((SECONDS - started)) -lt 600 ] || { echo "no first window after 600 s" >&2; exit 1; }
  sleep 1
done
echo "every group ended its first window after $((SECONDS - started)) s"
sleep "$KILL_AFTER"
step=$(squeue -h -s -j "$job" -o "%i %j" | awk '$2 == "group2" {print $1}')
echo "scancel --signal=KILL $step (group 2's job step) after $((SECONDS - started)) s"
scancel --signal=KILL "$step"
until [[ "$(state)" =~ ^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL)$ ]]; do
  [ $((SECONDS - started)) -lt 1800 ] || { echo "job $job not done after 1800 s" >&2; exit 1; }
  sleep 1
done
echo "job $job: $(state) after $((SECONDS - started)) s"
grep "replica group" "$STATE/jobs/lightning-dist-ft-$job.out" || true
for log in "$logs"/group*-*.log; do
  quorums=$(grep -c "lightning_dist: quorum" "$log" || true)
  discarded=$(grep -c "window discarded" "$log" || true)
  echo "--- $(basename "$log"): $quorums membership changes, $discarded discarded windows"
  grep -o "lightning_dist: quorum .*" "$log" | head -8 || true
  grep -o "global_step=[0-9]*\|max_steps=[0-9]* reached" "$log" | tail -1 || true
done
[ "$(state)" = COMPLETED ]
