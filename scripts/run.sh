#!/usr/bin/env bash
# One command from a fresh clone to a result:
#   scripts/run.sh test    set up .venv (first time) and run the test suite
#   scripts/run.sh demo    set up .venv (first time) and run the demo (python -m b12x_ops demo)
# Extra arguments go to pytest / the demo. Set B12X_OPS_PYTHON to use an existing interpreter
# (for example one that already has a CUDA build of torch) instead of creating .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-test}"
shift || true

if [ -n "${B12X_OPS_PYTHON:-}" ]; then
  py="$B12X_OPS_PYTHON"
else
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  py=.venv/bin/python
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    # the CPU build is what CI and the development machines use; override with TORCH_SPEC
    "$py" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
  "$py" -m pip install -q -e ".[test,b12x]"
fi

case "$what" in
  test)
    exec "$py" -m pytest -q -p no:cacheprovider tests "$@"
    ;;
  demo)
    exec "$py" -m b12x_ops demo "$@"
    ;;
  *)
    echo "usage: scripts/run.sh test|demo [args...]" >&2
    exit 2
    ;;
esac
