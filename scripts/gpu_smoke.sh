#!/usr/bin/env bash
# GPU smoke on ONE GPU, on a machine that already has CUDA torch and no network:
#
#   bash scripts/gpu_smoke.sh [WHEEL_DIR]
#
# WHEEL_DIR: made by scripts/make_gpu_wheels.sh (megatron-core 0.19.x, omegaconf, antlr4, ...),
# installed with --no-index --no-deps; the project runs from this source tree (PYTHONPATH).
# Runs, each independent (a failure is reported and the next still starts; exit 1 if any failed):
#   tiny_off / tiny_r3   the tiny default (warm start, local spec, bf16), 20 steps, replay off vs r3:
#                        reward must rise; routing agreement and k3 KL printed
#   1b_off / 1b_r3       a ~1B MoE (configs/gpu_smoke_1b.yaml: 64 experts top-8, random init, 256-token
#                        responses), 5 steps: learner MFU, tokens/s, peak memory, r3/off step time
#   te_bf16, te_fp8_*    Transformer Engine, if it imports (skipped otherwise)
#   vllm_r3              vLLM rollouts with R3, if vllm imports (skipped otherwise)
#   slice30b_offload / slice30b_resident
#                        a one-GPU slice of the Qwen3-30B-A3B recipe (configs/gpu_smoke_30b_slice.yaml:
#                        its layer shapes in 4 layers, TE bf16, vLLM sleep level 1, R3), 4 steps with
#                        parallel.offload_during_rollout on and off, if TE and vllm both import: the
#                        device's peak memory (nvidia-smi, sampled every 200 ms) against `moe-rl
#                        estimate` on this GPU's memory, step time, MFU, sync seconds
# Then one summary table (scripts/gpu_smoke_summary.py), and per run the device's peak in each phase
# (train, sync, generate; nvidia-smi's samples inside the run's memory-timeline spans) beside the
# estimate's (issue 41.6). Untested on GPU: no GPU was lent yet.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-}
PY=${PYTHON:-python}
OUT=${OUT:-runs/gpu_smoke_$(date +%s)}
PER_RUN_TIMEOUT=${PER_RUN_TIMEOUT:-300}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
  CUDA_DEVICE_MAX_CONNECTIONS=1

if [[ -n "$WHEELS" ]]; then
  $PY -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl 2>&1 | tail -n 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -m moe_rl.cli env | head -n 12 || { echo "moe-rl does not import: see above"; exit 1; }
mkdir -p "$OUT"

declare -a RUNS FAILED
run() {  # run LABEL CONFIG [overrides...]
  local label=$1 config=$2 rc; shift 2
  echo "=== $label: $config $*"
  # the device's used memory every 200 ms (vLLM's own pool included, which torch's counters miss)
  # with its time, so the summary can match each sample to the run's phases (memory_timeline.jsonl)
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -i 0 -lms 200 > "$OUT/$label.mem" &
  local sampler=$!
  timeout "$PER_RUN_TIMEOUT" $PY -m moe_rl.cli train "$config" run_dir="$OUT/$label" "$@" \
    > "$OUT/$label.log" 2>&1
  rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  if [[ $rc -eq 0 ]]; then
    cut -d, -f2 "$OUT/$label.mem" | sort -n | tail -n 1 > "$OUT/$label/device_peak_mib"
    cp "$OUT/$label.mem" "$OUT/$label/device_samples.csv"
    RUNS+=("$OUT/$label")
  else
    FAILED+=("$label (rc $rc): $(grep -E 'Error|error' "$OUT/$label.log" | tail -n 1 | cut -c1-300)")
  fi
}
TINY=(model.transformer_impl=local model.precision=bf16 steps=20)
run tiny_off configs/gpu_smoke.yaml "${TINY[@]}" routing.replay=off
run tiny_r3 configs/gpu_smoke.yaml "${TINY[@]}" routing.replay=r3
run 1b_off configs/gpu_smoke_1b.yaml routing.replay=off
run 1b_r3 configs/gpu_smoke_1b.yaml routing.replay=r3
if $PY -c "import transformer_engine.pytorch" 2>/dev/null; then
  run te_bf16 configs/gpu_smoke.yaml model.precision=bf16
  for recipe in delayed tensorwise blockwise; do
    run "te_fp8_$recipe" configs/gpu_smoke.yaml model.precision=fp8 model.fp8_recipe="$recipe"
  done
else
  echo "=== te_*: skipped (transformer_engine does not import)"
fi
if $PY -c "import vllm" 2>/dev/null; then
  run vllm_r3 configs/gpu_smoke.yaml model.transformer_impl=local model.precision=bf16 rollout.engine=vllm \
    routing.replay=r3 rollout.vllm.enforce_eager=true rollout.vllm.gpu_memory_utilization=0.3
else
  echo "=== vllm_r3: skipped (vllm does not import)"
fi

if $PY -c "import transformer_engine.pytorch, vllm" 2>/dev/null; then
  SLICE=configs/gpu_smoke_30b_slice.yaml
  run slice30b_offload "$SLICE" parallel.offload_during_rollout=true
  run slice30b_resident "$SLICE" parallel.offload_during_rollout=false
  # FP8 rollouts (issue 45; untested on GPU): vLLM 0.33's blockwise FP8 from the synced bf16 weights,
  # R3, and the checked sync (its probe k3 and time/sync_check_s land in the run's metrics)
  run slice30b_fp8_r3 "$SLICE" rollout.quantization=fp8 routing.replay=r3 rollout.sync_check=true
else
  echo "=== slice30b_*: skipped (transformer_engine and vllm must both import)"
fi

GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print $1 / 1024}')
echo; echo "=== summary ($OUT; estimates for a GPU of $GPU_GIB GiB)"
[[ ${#RUNS[@]} -gt 0 ]] && $PY scripts/gpu_smoke_summary.py --gpu-gib "$GPU_GIB" "${RUNS[@]}"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "=== failed"; printf '%s\n' "${FAILED[@]}"; exit 1
fi
