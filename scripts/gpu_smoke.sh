#!/usr/bin/env bash
# GPU smoke test on ONE H100/H200: a few RL steps of the tiny MoE with Transformer Engine (bf16, then
# FP8 with each recipe) and, if vLLM imports, vLLM rollouts with R3 routing replay. Prints per run:
# step time, tokens/s, MFU (6N per trained + 2N per forward-only token, N = active matmul params, vs
# 989 TFLOP/s bf16 dense) and routing agreement (1 - routing/flip_router_frac).
#
#   bash scripts/gpu_smoke.sh [WHEEL_DIR]
#
# WHEEL_DIR (optional; the device machine has no network): wheels of torch (CUDA), megatron-core,
# the project's dependencies, transformer-engine (+ its core and torch extension) and vllm, all
# installed with --no-index from there. Without it the current environment is used as is.
# Each run is independent: a failure is reported and the next run still starts. Exit 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-}
PY=${PYTHON:-python}
OUT=${OUT:-runs/gpu_smoke_$(date +%s)}
STEPS=${STEPS:-4}
PER_RUN_TIMEOUT=${PER_RUN_TIMEOUT:-240}
export WANDB_MODE=disabled TORCH_NCCL_ASYNC_ERROR_HANDLING=1 CUDA_DEVICE_MAX_CONNECTIONS=1

if [[ -n "$WHEELS" ]]; then
  pip_() { $PY -m pip install --no-index --find-links "$WHEELS" "$@" 2>&1 | tail -n 2; }
  pip_ torch
  pip_ --no-build-isolation -e '.[test]'
  ls "$WHEELS" | grep -qi '^transformer_engine' && pip_ --no-build-isolation 'transformer-engine[pytorch]'
  ls "$WHEELS" | grep -qi '^vllm' && pip_ vllm
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -m moe_rl.cli env | head -n 10

declare -a SUMMARY FAILED
run() {  # run LABEL [overrides...]
  local label=$1; shift
  local dir="$OUT/$label"
  echo "=== $label: $*"
  if timeout "$PER_RUN_TIMEOUT" $PY -m moe_rl.cli train configs/gpu_smoke.yaml run_dir="$dir" steps="$STEPS" "$@" \
      > "$OUT/$label.log" 2>&1; then
    SUMMARY+=("$($PY scripts/gpu_smoke_summary.py "$dir" --label "$label" 2>&1 | tail -n 1)")
  else
    FAILED+=("$label (rc $?): $(grep -E 'Error|error' "$OUT/$label.log" | tail -n 1 | cut -c1-300)")
  fi
}
mkdir -p "$OUT"
run local_bf16 model.transformer_impl=local model.precision=bf16   # baseline: megatron's own modules
run te_bf16 model.precision=bf16
for recipe in delayed tensorwise blockwise; do
  run "te_fp8_$recipe" model.precision=fp8 model.fp8_recipe="$recipe"
done
if $PY -c "import vllm" 2>/dev/null; then
  run vllm_r3 model.precision=bf16 rollout.engine=vllm routing.replay=r3 rollout.vllm.enforce_eager=true \
    rollout.vllm.gpu_memory_utilization=0.3
else
  echo "=== vllm_r3: skipped (vllm does not import)"
fi

echo; echo "=== summary ($OUT)"
printf '%s\n' "${SUMMARY[@]:-}"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "=== failed"; printf '%s\n' "${FAILED[@]}"; exit 1
fi
