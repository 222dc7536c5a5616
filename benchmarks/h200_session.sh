#!/usr/bin/env bash
# One device call: the GPU tests, then the benchmark. Results land under $OUT (or ./out).
# usage: bash benchmarks/h200_session.sh [tests|ptests|bench|all|offhopper|sync16|h200next] [extra bench args...]
# offhopper: other GPUs' plans on this one standing in (an sm_89 GPU's): their GPU test, then the whole op with the
# tl.dot GEMMs (B12X_OPS_TRITON_GLUON_SYNC=0) and with the Gluon GEMMs on mma.sync (the default there) in one run
# (benchmarks/compare_trees.sh; results under $OUT/tl and $OUT/sync).
# sync16: on sm_90, the 16-row plans' GEMMs on mma.sync (B12X_OPS_TRITON_GLUON_SYNC16=1): their GPU test, then the
# whole op at 8-128 tokens with and without them in one run (results under $OUT/wgmma and $OUT/sync16).
# h200next: the H200 items NOTES lists after sync16 and the table, each step under its own limit so that one call
# of about 540 s holds them: the GEMV's loads in flight at 4 and 8 tokens (gemv_mma_forms.py, Qwen3 then gpt-oss),
# then the 16-row plans' stage sweep (sweep_blocked.py); logs $OUT/gemv_forms.log and $OUT/sweep16.log.
# ptests: the whole GPU suite in thirteen processes at once (its time is mostly compiling, on the CPU:
# about 4-6 minutes on the H100/H200 machines against 15 or more in one process; each process stops at
# PTESTS_TIMEOUT, default 400 s), one log.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export B12X_OPS_CACHE_DIR=${B12X_OPS_CACHE_DIR:-/tmp/b12x_ops_cache}
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 240 python3 -m pytest tests/test_triton_gpu.py -q --maxfail=6 -rs -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ "$what" = ptests ]; then
  # thirteen processes, the Gluon test (the slowest, about 2 minutes a geometry) one or two geometries
  # each; their logs go to one file ($OUT/gpu_tests.log: the device returns few files)
  groups=("test_gpu_matches_reference" "gluon and gpt" "gluon and odd-ep" "gluon and (dsv4 or odd-3x96)"
          "(gluon and qwen3) or tuner" "routing or (deterministic and not gemv)" "gemv and not mma" "mma"
          "ptx or short_k" "every_tile" "half_tiles or edge_tiles" "pdl"
          "not test_gpu_matches_reference and not gluon and not tuner and not routing and not deterministic and not gemv and not ptx and not short_k and not every_tile and not half_tiles and not edge_tiles and not pdl")
  tmp=$(mktemp -d)
  for i in "${!groups[@]}"; do
    B12X_OPS_CACHE_DIR="$B12X_OPS_CACHE_DIR/p$i" setsid timeout -k 5 "${PTESTS_TIMEOUT:-400}" python3 -m pytest \
      tests/test_triton_gpu.py -q -rfEs -p no:cacheprovider -k "${groups[$i]}" > "$tmp/$i.log" 2>&1 &
  done
  wait
  for i in "${!groups[@]}"; do
    echo "# process $i: python3 -m pytest tests/test_triton_gpu.py -q -rfEs -p no:cacheprovider -k \"${groups[$i]}\""
    grep -v "^$" "$tmp/$i.log" | grep -v "DeprecationWarning\|warnings.warn\|Docs: https\|warnings summary\|: [0-9]* warnings$"
    echo
  done > "$OUT/gpu_tests.log"
  grep -v "^\.*$" "$OUT/gpu_tests.log"
fi
peers=(); [ -d .peers/triton_kernels ] && peers=(--triton-kernels .peers)
# compare K VAR LABEL_OFF LABEL_ON [bench args...]: the GPU tests selected by -k K, then the whole op with VAR=0 and
# VAR=1 in one run (benchmarks/compare_trees.sh)
compare() {
  local k=$1 var=$2 off=$3 on=$4; shift 4
  timeout 240 python3 -m pytest tests/test_triton_gpu.py -q -rfEs -p no:cacheprovider -k "$k" 2>&1 | tee "$OUT/gpu_tests.log" | tail -20
  OUT="$OUT" bash benchmarks/compare_trees.sh "$off=.:$var=0" "$on=.:$var=1" -- "${peers[@]}" --no-tune --layers 4 \
    --reps 10 --bf16-layers 0 --diagnose --geometries qwen3-30b-a3b dsv4.1-tp4 gpt-oss-120b "$@" 2>&1 | tail -80
}
if [ "$what" = offhopper ]; then
  compare other_gpus B12X_OPS_TRITON_GLUON_SYNC tl sync --as-sm 89 --sizes 8 16 32 64 128 512 2048 8192 "$@"
fi
if [ "$what" = sync16 ]; then
  compare sync16 B12X_OPS_TRITON_GLUON_SYNC16 wgmma sync16 --sizes 8 16 32 64 128 "$@"
fi
if [ "$what" = h200next ]; then
  { timeout 170 python3 benchmarks/experiments/gemv_mma_forms.py qwen3-30b-a3b 4,8 8/6@2,8/6@3,8/6@4,16/6@2,16/6@3,16/6@4 2
    timeout 170 python3 benchmarks/experiments/gemv_mma_forms.py gpt-oss-120b 4,8 15/9@2,15/9@3,15/9@4,9/9@2,9/9@3 2
  } 2>&1 | tee "$OUT/gemv_forms.log" | grep -v "Warning\|warn("
  timeout 170 python3 benchmarks/sweep_blocked.py --ptx-only --layers 4 --bm 16 --sizes 16 64 --budget 150 \
    --geometries gpt-oss-120b qwen3-30b-a3b --g1 64,128,4,3 64,128,4,5 64,64,4,6,g 64,64,4,8,g \
    --g2 128,128,4,3 64,128,4,3 128,128,4,5 128,64,4,6,g 2>&1 | tee "$OUT/sweep16.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_moe.py "${peers[@]}" --out "$OUT/results" "$@" 2>&1 | tee "$OUT/bench.log"
fi
