#!/usr/bin/env bash
# The one-call GPU check; bench/gpu_check.py does the work (its docstring and
# docs/performance.md, "GPU", say what runs and what is measured).
#
#   bash bench/gpu_check.sh                           # a GPU machine: at most 6 minutes
#   bash bench/gpu_check.sh --rerun-failed OLD.json   # only what failed there: 2 minutes
#   bash bench/gpu_check.sh --dry-run                 # the same pipeline on the host backend
#   bash bench/gpu_check.sh --plan                    # each stage's planned time, nothing run
#
# Three stages (core by 50% of the deadline, ipc by 72%, rest), each cut at its own end.
# .whl/ (the lmdb, mpi4py and mpich wheels) is ignored by git: whatever copies this
# checkout to the GPU machine must carry it explicitly, or the process groups' GPU tests
# skip and the check fails.
#
# Results: $OUT/gpu_check.json (else out/gpu-check/), rewritten as the check goes; the
# summary is printed last; the exit status is 0 only if everything passed.
# Environment: PYTHON, the interpreter with CuPy, pytest and the build tools (default python3).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
