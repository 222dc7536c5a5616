#!/usr/bin/env bash
# One quick device call (< 200 s): (1) the GPU tests of the small-M GEMV path (both paths against
# the reference), (2) GEMV vs blocked path timings at M = 1..16 for the three benchmark geometries
# (CUDA-graph replay over 4 layers, tune=False) plus the whole op per GEMV tile candidate at M = 1
# and 8, the tables printed last. Logs land under $OUT (tests: quick_tests.log; bench:
# quick_bench.log, gemv_compare.md, rewritten after every geometry so a cut-short run keeps it).
# usage: bash benchmarks/h200_quick.sh
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export B12X_OPS_CACHE_DIR=${B12X_OPS_CACHE_DIR:-/tmp/b12x_ops_cache}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# (1) tests (the tuner's cache round trip too: it now times candidates from CUDA graphs): a failure
# is reported, never stops (2)
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py \
  -k "${QUICK_K:-(gemv_path and (odd-ep or qwen3 or gpt-oss)) or tuning_cache}" > "$OUT/quick_tests.log" 2>&1
test_rc=$?
tail -25 "$OUT/quick_tests.log"
echo "== GPU tests exit code $test_rc ($( [ $test_rc = 0 ] && echo PASSED || echo FAILED, see $OUT/quick_tests.log)), $(( $(date +%s) - t0 )) s so far"

# (2) timings; the table is the last thing printed
timeout 125 python3 benchmarks/bench_moe.py --gemv-compare --gemv-sweep 1 8 --no-tune --layers 4 --reps 20 \
  --sizes 1 2 4 8 16 --out "$OUT" > "$OUT/quick_bench.log" 2>&1
bench_rc=$?
grep -v '^|' "$OUT/quick_bench.log" | grep -v '^GEMV' | tail -30
echo "== bench exit code $bench_rc; GPU tests exit code $test_rc; total $(( $(date +%s) - t0 )) s"
if [ -f "$OUT/gemv_compare.md" ]; then cat "$OUT/gemv_compare.md"; else echo "(no table: the bench failed, see above)"; fi
