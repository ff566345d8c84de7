#!/usr/bin/env bash
# Run a `megappo` command under torchrun on this node. In a multi-node job, run it once on every node
# (under Slurm: `srun --ntasks-per-node=1 launch/torchrun.sh ...`; launch/slurm/*.sbatch do it).
#
#   launch/torchrun.sh [--nproc-per-node N] MEGAPPO_ARGS...
#   e.g. launch/torchrun.sh --nproc-per-node 4 train --config recipes/cpu/tiny_ppo_tp2pp2.yaml key=value ...
#        launch/torchrun.sh --nproc-per-node 8 convert hf-to-mcore --hf Qwen3-8B --out ckpt/q3 --tp 2 --pp 2
#
# Nodes: NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT when set, else the Slurm step's (node count, this node's
# place in it, its first node, port 20000 + job id % 20000), else one node on localhost. Global rank 0 is on node
# rank 0. Ranks per node: --nproc-per-node, else NPROC_PER_NODE, else one per visible GPU, else 1.
# Exit status: megappo's own (0, 1, 3 stopped, 75 preempted: requeue), not torchrun's 1 for all of them; 2 when
# a node did not join within MEGAPPO_JOIN_TIMEOUT seconds (600; the message names it) or the arguments are wrong.
# SIGTERM/SIGUSR1 to this script (SIGUSR2 from launch/slurm/*.sbatch) and Ctrl-C (SIGINT) reach the workers, not
# torchrun: they save a checkpoint and exit 75.
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

nproc=${NPROC_PER_NODE:-}
case "${1:-}" in
  --nproc-per-node) nproc=${2:?--nproc-per-node needs a number}; shift 2 ;;
  --nproc-per-node=*) nproc=${1#*=}; shift ;;
  -h|--help) usage; exit 0 ;;
esac
if [ $# -eq 0 ]; then
  usage >&2
  exit 2
fi
if [ -z "$nproc" ]; then
  nproc=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

# Explicit variables win over Slurm's, so a launch inside an allocation can still describe its own layout.
# SLURM_STEP_* describe this srun step, which may cover only part of the job (launch/slurm/train_sglang.sbatch).
slurm_nodes=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}
nnodes=${NNODES:-${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-1}}}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}  # SLURM_NODEID counts within the step
if [ -n "${MASTER_ADDR:-}" ]; then
  master_addr=$MASTER_ADDR
elif [ -n "$slurm_nodes" ]; then
  # the step's first node, at the address Slurm itself reaches it by (NodeAddr: its name unless configured)
  master_addr=$(scontrol show hostnames "$slurm_nodes" | head -n 1)
  node_addr=$(scontrol show node "$master_addr" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
  master_addr=${node_addr:-$master_addr}
elif [ "$nnodes" -gt 1 ]; then
  # each node would wait for itself on its own 127.0.0.1 until the rendezvous timed out
  echo "torchrun.sh: NNODES=$nnodes but MASTER_ADDR is not set; set it to node rank 0's address on every node" >&2
  exit 2
else
  master_addr=127.0.0.1
fi
if [ -n "${MASTER_PORT:-}" ]; then
  master_port=$MASTER_PORT
elif [ -n "${SLURM_JOB_ID:-}" ]; then
  master_port=$((20000 + SLURM_JOB_ID % 20000))  # jobs sharing a node collide only 20000 job ids apart
else
  master_port=29500
fi

# One thread per rank unless told otherwise: ranks share the node's cores (on 2 cores, 2 threads per rank
# measured 3-4x slower than 1).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$nnodes" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then
  rdzv=(--standalone)  # a free port on localhost: single-node runs never collide
else
  # static rendezvous: node ranks follow the node order given (c10d's follow sorted host names), so rank 0 is on
  # the first node, the address that rollout.weight_sync_master_address and friends name
  rdzv=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
fi

# Every node joins before torchrun starts, so that a node that never comes is named within MEGAPPO_JOIN_TIMEOUT
# seconds (default 600) instead of ending in torchrun's unnamed rendezvous timeout (megappo/platform/join.py; node 0
# listens on MASTER_PORT+1 for the check's length).
if [ "$nnodes" -gt 1 ]; then
  hosts=
  if [ -n "$slurm_nodes" ] && [ -z "${NODE_RANK:-}" ]; then
    hosts=$(scontrol show hostnames "$slurm_nodes" | paste -sd, -)  # node ranks follow this order
  fi
  TORCH_CPP_LOG_LEVEL=FATAL python -m megappo.platform.join --nnodes "$nnodes" --node-rank "$node_rank" \
    --master-addr "$master_addr" --port $((master_port + 1)) --nproc "$nproc" \
    --timeout "${MEGAPPO_JOIN_TIMEOUT:-600}" ${hosts:+--hosts "$hosts"} || exit 2
fi

# megappo's trainer writes its ending here too (megappo/trainer/preemption.py), on every node: torchrun turns a
# worker's 75 or 3 into its own 1. A fresh directory per invocation: a file from an earlier run is never read.
status_dir=$(mktemp -d "${TMPDIR:-/tmp}/megappo-launch.XXXXXX")
export MEGAPPO_STATUS_FILE=$status_dir/status.json

torchrun_pid=
cleanup() {
  if [ -n "$torchrun_pid" ] && kill -0 "$torchrun_pid" 2>/dev/null; then
    # never leave torchrun behind: on TERM it stops its workers (TERM, then KILL after its grace period)
    kill -TERM "$torchrun_pid" 2>/dev/null || true
    wait "$torchrun_pid" 2>/dev/null || true
  fi
  rm -rf "$status_dir"
}
trap cleanup EXIT

# Who gets a signal. Only the trainer's ranks (torchrun's children) may get a stop request, once: a second one (5 s
# or more after the first; copies within 5 s are ignored) stops the trainer at once, without its checkpoint; torchrun
# would stop its workers itself (SIGTERM, then
# SIGKILL 30 s later) or die of SIGUSR1 and orphan them; and the ranks' helper processes (checkpoint writers,
# reward pools, rollout servers) must not get it at all.
# - SIGTERM/SIGUSR1 to this script: passed on to the ranks. Under a Slurm step they are not: Slurm signals every
#   process of the step itself (scancel, --signal without B:), so the ranks have it already.
# - SIGINT (Ctrl-C): passed on to the ranks, or under a Slurm step left to srun, which sends it to every process.
#   torchrun ignores it (a background command of a script starts with SIGINT ignored, and torchrun is told not to
#   handle it), so it neither stops its workers itself nor dies with a traceback.
# - SIGUSR2: the stop request launch/slurm/*.sbatch relay through srun, which signals every process of the step;
#   everything below this script ignores SIGUSR2 (ignored dispositions are inherited, across exec too), and this
#   script passes it on to the ranks as SIGUSR1.
if [ -n "${SLURM_STEP_ID:-}" ]; then direct=0; else direct=1; fi
to_ranks() {  # SIGNAL_RECEIVED SIGNAL_TO_SEND
  local ranks
  if [ "$1" != USR2 ] && [ "$direct" = 0 ]; then
    echo "torchrun.sh: SIG$1: Slurm signalled the ranks too; waiting for them to save and exit" >&2
    return 0
  fi
  ranks=$(pgrep -P "$torchrun_pid" | tr '\n' ' ' || true)
  echo "torchrun.sh: SIG$1 -> SIG$2 to the ranks ${ranks:-(none started yet)}; waiting for them to save and exit" >&2
  # shellcheck disable=SC2086
  [ -z "$ranks" ] || kill -s "$2" $ranks 2>/dev/null || true
}

# torchrun, its workers and their children ignore both (the trainer installs its own SIGUSR1 handler once set up).
trap '' USR1 USR2
PET_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT \
  python -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$nproc" -m megappo.cli "$@" &
torchrun_pid=$!
trap 'to_ranks TERM TERM' TERM
trap 'to_ranks INT INT' INT
trap 'to_ranks USR1 USR1' USR1
trap 'to_ranks USR2 USR1' USR2

# `wait` returns early whenever a trapped signal arrives; bash keeps the exit status of a reaped child
while kill -0 "$torchrun_pid" 2>/dev/null; do
  wait "$torchrun_pid" 2>/dev/null || true
done
rc=0
wait "$torchrun_pid" || rc=$?
torchrun_pid=

status=
if [ -s "$MEGAPPO_STATUS_FILE" ]; then
  status=$(python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("status", ""))' \
    "$MEGAPPO_STATUS_FILE" 2>/dev/null || true)
fi
case "$status" in
  preempted) exit 75 ;;  # saved a checkpoint: run the same command again (launch/slurm/*.sbatch requeue)
  stopped) exit 3 ;;     # the KL guard or the reward watch stopped the run on purpose
  finished) exit 0 ;;    # a signal during the last step: torchrun says 1 for its own, but the run is complete
  *) exit "$rc" ;;
esac
