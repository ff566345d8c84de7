#!/usr/bin/env bash
# Run a `megappo` command under torchrun on this node. In a multi-node job, run it once on every node
# (under Slurm: `srun --ntasks-per-node=1 launch/torchrun.sh ...`).
#
#   launch/torchrun.sh [--nproc-per-node N] MEGAPPO_ARGS...
#   e.g. launch/torchrun.sh --nproc-per-node 8 convert hf-to-mcore --hf Qwen3-8B --out ckpt/q3 --tp 2 --pp 2
#
# Nodes and rendezvous come from Slurm when it is there (SLURM_NNODES, SLURM_NODEID, the first host of
# SLURM_JOB_NODELIST), else from NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (one node on localhost by default).
# Ranks per node: --nproc-per-node, else NPROC_PER_NODE, else one per visible GPU, else 1 on a CPU-only node.
set -euo pipefail

nproc=${NPROC_PER_NODE:-}
if [ "${1:-}" = "--nproc-per-node" ]; then
  nproc=$2
  shift 2
fi
if [ $# -eq 0 ]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
if [ -z "$nproc" ]; then
  nproc=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  nnodes=${SLURM_NNODES:-1}
  node_rank=${SLURM_NODEID:-0}
  master_addr=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
  nnodes=${NNODES:-1}
  node_rank=${NODE_RANK:-0}
  master_addr=${MASTER_ADDR:-127.0.0.1}
fi
master_port=${MASTER_PORT:-29500}

# One thread per rank unless told otherwise: ranks share the node's cores (on 2 cores, 2 threads per rank
# measured 3-4x slower than 1).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$nnodes" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then
  rdzv=(--standalone)  # a free port on localhost: single-node runs never collide
else
  rdzv=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
fi
exec torchrun "${rdzv[@]}" --nproc-per-node "$nproc" -m megappo.cli "$@"
