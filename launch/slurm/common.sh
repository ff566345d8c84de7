# Shared by launch/slurm/*.sbatch and launch/convert.sbatch, which source it once they know the repository
# (MEGAPPO_HOME).
# shellcheck shell=bash

megappo_die() {
  echo "megappo: $*" >&2
  exit 2
}

MEGAPPO_HOME=$(cd "$MEGAPPO_HOME" && pwd)  # absolute: every step on every node uses it
export MEGAPPO_HOME

# The Python environment: MEGAPPO_VENV, else whatever `python` already imports megappo (sbatch passes the
# submitting shell's environment, an activated venv included). Steps inherit it from this shell.
megappo_python_env() {
  if [ -n "${MEGAPPO_VENV:-}" ]; then
    [ -f "$MEGAPPO_VENV/bin/activate" ] || megappo_die "MEGAPPO_VENV=$MEGAPPO_VENV has no bin/activate"
    set +u  # activate scripts of some virtualenv versions read unset variables
    # shellcheck disable=SC1091
    . "$MEGAPPO_VENV/bin/activate"
    set -u
  fi
  local where
  where=$(python -c "import megappo, os; print(os.path.dirname(os.path.dirname(megappo.__file__)))" 2>/dev/null) ||
    megappo_die "no Python environment with megappo here: set MEGAPPO_VENV=/path/to/venv (made with" \
      "pip install -e $MEGAPPO_HOME), or activate it before sbatch"
  echo "megappo: $(python --version 2>&1) at $(command -v python), megappo from $where"
}

# Ranks per node: NPROC_PER_NODE, else GPUS_PER_NODE, else the GPUs this job asked for per node, else 1 (CPU).
megappo_ranks_per_node() {
  if [ -n "${NPROC_PER_NODE:-}" ]; then
    echo "$NPROC_PER_NODE"
    return
  fi
  local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}}
  gpus=${gpus##*:}  # --gpus-per-node=h100:8
  if [ "$gpus" -gt 0 ] && [ -z "${SLURM_GPUS_ON_NODE:-}${SLURM_JOB_GPUS:-}${CUDA_VISIBLE_DEVICES:-}" ]; then
    megappo_die "GPUS_PER_NODE=$gpus but this job has no GPUs: submit with sbatch --gpus-per-node=$gpus"
  fi
  if [ "$gpus" -gt 0 ]; then echo "$gpus"; else echo 1; fi
}

# Run the trainer's `srun ARGS...` in the background: bash runs traps only between commands, so a foreground srun
# would hold back --signal=B:USR1 until the step ended. SIGUSR1 or SIGTERM to this script becomes SIGUSR2 to that
# srun, which relays it to every process of the step on every node; only launch/torchrun.sh acts on it (the rest
# ignore it) and passes SIGUSR1 to its ranks, which finish the step, save a checkpoint and exit 75. Not SIGUSR1:
# the ranks' helper processes would get it too; not SIGTERM: srun answers it by killing the step.
# Returns srun's exit status, the highest of its tasks'.
MEGAPPO_STEP_PID=
_megappo_stop_step() {
  echo "megappo: SIG$1 in the batch script: asking the trainer to save a checkpoint and exit 75 (then the job is" \
    "requeued)" >&2
  [ -z "$MEGAPPO_STEP_PID" ] || kill -USR2 "$MEGAPPO_STEP_PID" 2>/dev/null || true
}
megappo_run_step() {
  trap '_megappo_stop_step USR1' USR1
  trap '_megappo_stop_step TERM' TERM
  srun "$@" &
  MEGAPPO_STEP_PID=$!
  while kill -0 "$MEGAPPO_STEP_PID" 2>/dev/null; do
    wait "$MEGAPPO_STEP_PID" 2>/dev/null || true  # returns early on each trapped signal
  done
  local rc=0
  wait "$MEGAPPO_STEP_PID" || rc=$?
  MEGAPPO_STEP_PID=
  return "$rc"
}

# The trainer's exit status: 75 (preempted, checkpoint saved) requeues this job, whose next run resumes from that
# checkpoint (the .sbatch files add trainer.resume_mode=auto on restarts); anything else ends it with that status.
megappo_finish() {
  local rc=$1
  if [ "$rc" -eq 75 ]; then
    echo "megappo: preempted after a checkpoint: requeueing job $SLURM_JOB_ID (restart" \
      "$((${SLURM_RESTART_COUNT:-0} + 1)))" >&2
    trap - USR1 TERM  # the requeue ends this script; nothing is left to forward
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0
    fi
    echo "megappo: scontrol requeue failed: submit the same command again; it resumes from the checkpoint" >&2
  fi
  exit "$rc"
}
