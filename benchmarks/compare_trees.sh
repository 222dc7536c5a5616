#!/usr/bin/env bash
# The whole op on several source trees in one device call: each tree is a folder holding the
# b12x_ops package and benchmarks/ (a branch exported with
# `git archive <branch> b12x_ops benchmarks | tar -x -C <dir>`), timed by its own
# benchmarks/bench_moe.py (which puts its tree first on sys.path) in a process of its own.
#
#   bash benchmarks/compare_trees.sh main=. nofuse=.:B12X_OPS_TRITON_GEMV_FUSED=0 \
#       -- --no-tune --layers 4 --reps 10 --bf16-layers 0 --sizes 1 2 4
#
# Each argument before `--` is LABEL=DIR[:VAR=VALUE[:VAR=VALUE...]]; what follows `--` goes to
# bench_moe.py. Results land under $OUT/<label>/ (results.md, results.json), logs in $OUT/<label>.log;
# the tables' rows are printed per label. DRY_RUN=1 prints the commands instead.
set -euo pipefail
OUT=${OUT:-out}
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$1"); shift; done
[ $# -gt 0 ] && shift
for spec in "${trees[@]}"; do
  label=${spec%%=*}
  rest=${spec#*=}
  IFS=: read -r -a parts <<< "$rest"
  dir=${parts[0]}
  envs=("${parts[@]:1}")
  [ -d "$dir/b12x_ops" ] && [ -f "$dir/benchmarks/bench_moe.py" ] || {
    echo "compare_trees: $dir holds no b12x_ops and benchmarks/bench_moe.py" >&2; exit 2; }
  cmd=(env "${envs[@]}" python3 "$dir/benchmarks/bench_moe.py" --out "$OUT/$label" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "$label: ${cmd[*]}"; continue; fi
  mkdir -p "$OUT"
  echo "=== $label (${envs[*]:-no extra env})"
  "${cmd[@]}" > "$OUT/$label.log" 2>&1 || echo "($label: bench exited $?)"
  grep -h "^## \|^| [0-9]" "$OUT/$label/results.md" 2>/dev/null | grep -v "grid" || tail -5 "$OUT/$label.log"
done
