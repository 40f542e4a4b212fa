#!/usr/bin/env bash
# Runs one megarlhf stage inside a Slurm allocation: one task per GPU via srun (each task
# reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the rendezvous host is the first node
# of the allocation, the port derived from the job id). Preemption: SIGUSR1/SIGTERM to this
# script (#SBATCH --signal=B:USR1@120) is forwarded to the tasks, which checkpoint at the
# next safe point and leave a PREEMPTED marker; the job then requeues itself and, when it
# starts again, resumes from that checkpoint. A rank that stopped answering makes the others
# exit and leave a STALLED marker (parallel/watchdog.py): the job requeues the same way.
#   slurm/launch.sh RUN_DIR PYTHON STAGE CONFIG [key=value ...]
set -uo pipefail
run_dir="$1"; python="$2"; shift 2
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
echo "[launch] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES node(s) x" \
     "${SLURM_NTASKS_PER_NODE:-?} task(s), rendezvous $MASTER_ADDR:$MASTER_PORT, stage $*"
srun --kill-on-bad-exit=1 "$python" -m megarlhf.cli "$@" &
srun_pid=$!
forward() { echo "[launch] signal received (a preemption, or Slurm ending the job): asking the tasks to checkpoint"; kill -USR1 "$srun_pid" 2>/dev/null; }
trap forward USR1 TERM
# A job Slurm is already ending - a user's scancel, an operator's scontrol requeue, a node
# failure: Slurm shows it COMPLETING while this script runs (seen with Slurm 22.05) - is left
# to Slurm: a requeue here would bring a cancelled job back, and Slurm requeues the others
# itself. A job still RUNNING (the --signal=B:USR1 warning before a preemption or the time
# limit, a rank that stopped answering) is requeued here.
requeue() {
    local state
    state="$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*')"
    state="${state#JobState=}"
    if [ "$state" = COMPLETING ] || [ "$state" = CANCELLED ]; then
        echo "[launch] $1; Slurm is ending job $SLURM_JOB_ID (JobState=$state: a scancel, or a requeue of Slurm's own): not requeueing it here (a cancelled job resumes when the same command is submitted again)"
        return
    fi
    echo "[launch] $1; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
}
status=0
while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid"; status=$?
done
if [ -f "$run_dir/STALLED" ]; then
    # `read`, a builtin: a command substitution forks, and the SIGTERM Slurm sends when it
    # cancels the step after a node failure would kill it before it prints
    IFS= read -r stalled < "$run_dir/STALLED" || true
    echo "[launch] a rank stopped answering: $stalled"
    rm -f "$run_dir/STALLED"
    if [ "$status" -ne 0 ]; then
        requeue "the last checkpoint is intact"
        exit 0
    fi
fi
if [ -f "$run_dir/PREEMPTED" ]; then
    IFS= read -r preempted < "$run_dir/PREEMPTED" || true
    rm -f "$run_dir/PREEMPTED"
    requeue "checkpoint written at $preempted"
    exit 0
fi
exit "$status"
