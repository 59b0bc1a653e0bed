#!/usr/bin/env bash
# Multi-node training by hand: run this on EVERY node, same arguments except NODE_RANK.
#
#   bash scripts/torchrun_multinode.sh NNODES NODE_RANK MASTER_ADDR [CONFIG.yaml] [key=value ...]
#   e.g. node 0: bash scripts/torchrun_multinode.sh 4 0 10.0.0.1 configs/qwen3_235b_a22b_4x8h100.yaml
#        nodes 1-3: the same with NODE_RANK 1, 2, 3
#
# One torchrun agent per node (moe_rl/multinode.py runs it: c10d rendezvous on MASTER_ADDR:MASTER_PORT)
# starts GPUS_PER_NODE ranks and sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR, so `python -m
# moe_rl.cli train` runs as that rank (moe_rl/launch.py: external-torchrun mode). The config's
# parallel.nproc must equal NNODES x GPUS_PER_NODE; that, MASTER_ADDR and a free MASTER_PORT are
# checked before any rank starts (one `error:` line). No config: the embedded tiny CPU default.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '4,6p' "$0"; exit 2
fi
NNODES=$1 NODE_RANK=$2 MASTER_ADDR=${3:-}; shift $(($# < 3 ? $# : 3))
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
MASTER_PORT=${MASTER_PORT:-29500}
cd "$(dirname "$0")/.."
source scripts/cluster_env.sh 2>/dev/null || true  # site NCCL settings, if you keep them there
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead rank fails the job
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's comm/compute overlap order
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export WANDB_MODE=${WANDB_MODE:-offline}
# a first SIGTERM/Ctrl-C: the ranks finish their step and save a checkpoint; torchrun's agent
# SIGKILLs them after this many seconds (docs/reliability.md 9: torchrun's --shutdown-timeout)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-120}
exec "${PYTHON:-python}" -m moe_rl.multinode --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  --rdzv-id "moe-rl-$MASTER_ADDR-$MASTER_PORT" -- "$@"
