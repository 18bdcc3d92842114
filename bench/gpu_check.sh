#!/usr/bin/env bash
# The GPU check (issue 30): see bench/gpu_check.py and docs/benchmarks/gpu.md.
#   bench/gpu_check.sh prepare            # here: .gpu-check/bundle-N (wheels, sdist, GGUF parts)
#   bench/gpu_check.sh receive            # on the GPU machine, once per carried bundle
#   bench/gpu_check.sh run [--dry-run]    # on the GPU machine: build, test, measure
# Never run by CI. Standard library Python 3.11+ only; on the GPU machine it needs nvcc,
# cmake and a C++ compiler, and no network.
set -euo pipefail
if [ -n "${CI:-}" ]; then
    echo "bench/gpu_check.sh: never run by CI (CI is set)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PY=python3
# prepare reads the project's environment (installed versions, the GGUF): use its python.
if [ "${1:-}" = "prepare" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
exec "$PY" bench/gpu_check.py "$@"
