#!/usr/bin/env bash
# Issue 5's two-GPU run: EP = 2 and TP = 2 checked, then timed, on one host with two GPUs.
#
#   bash benchmarks/run_distributed_h200x2.sh            # results in $OUT (else benchmarks/results)
#
# 1. --check: for the three benchmark geometries, EP = 2 and TP = 2 all-reduced outputs against the
#    single-GPU layer and the CPU reference; padding rows; on the first geometry the compiled layer
#    (fullgraph: one b12x node, one all-reduce), torch.cuda.graph replay, mode="reduce-overhead".
# 2. --bench: per-rank CUDA-graph replay time of the op and of op + all-reduce at M = 16, 512, 4096,
#    against the single-GPU layer: distributed_both_bench.{json,md}.
# Each step has a wall-clock cap and the example a collective timeout, so a stuck rank fails the
# step instead of hanging; the whole script stays under about 6 minutes.
set -uo pipefail

# NVLink multicast must stay off on these shared hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/distributed_log.txt"
PY="${PYTHON:-python3}"
# EXTRA="--device cpu --tiny" rehearses the script on a CPU machine (gloo, reference backend)
EXTRA="${EXTRA:-}"

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
  nvidia-smi topo -m || true
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$LOG"

launch() {  # launch SECONDS ARGS...: two ranks of the example, capped at SECONDS
  local cap=$1; shift
  echo "== $(date -u +%T) examples/distributed_moe.py $*" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "$cap" \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    examples/distributed_moe.py --out "$OUT_DIR" --timeout-s 90 "$@" $EXTRA 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc after step: $*" | tee -a "$LOG"
  return "$rc"
}

status=0
# smallest geometry first, so the compile and CUDA-graph checks (first geometry only) come early
launch 170 --mode both --check --budget-s 110 \
  --geometry qwen3-30b-a3b gpt-oss-120b deepseek-v4.1-tp4 || status=1
launch 190 --mode both --bench --budget-s 120 \
  --geometry gpt-oss-120b deepseek-v4.1-tp4 qwen3-30b-a3b || status=1
echo "run_distributed_h200x2: $([ $status = 0 ] && echo OK || echo FAILED) (results in $OUT_DIR)" | tee -a "$LOG"
exit $status
