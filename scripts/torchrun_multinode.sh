#!/usr/bin/env bash
# Multi-node training by hand: run this on EVERY node, same arguments except NODE_RANK.
#
#   bash scripts/torchrun_multinode.sh NNODES NODE_RANK MASTER_ADDR CONFIG.yaml [key=value ...]
#   e.g. node 0: bash scripts/torchrun_multinode.sh 4 0 10.0.0.1 configs/qwen3_235b_a22b_4x8h100.yaml
#        nodes 1-3: the same with NODE_RANK 1, 2, 3
#
# torchrun starts GPUS_PER_NODE ranks per node and sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR, so
# `python -m moe_rl.cli train` runs as that rank (moe_rl/launch.py: external-torchrun mode) instead
# of starting its own. parallel.nproc is set to the world size (the config is validated against it).
set -euo pipefail
if [[ $# -lt 4 ]]; then
  sed -n '2,5p' "$0"; exit 2
fi
NNODES=$1 NODE_RANK=$2 MASTER_ADDR=$3 CONFIG=$4; shift 4
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
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "moe-rl-$MASTER_ADDR" \
  --max_restarts 0 \
  -m moe_rl.cli train "$CONFIG" parallel.nproc=$((NNODES * GPUS_PER_NODE)) "$@"
