#!/usr/bin/env bash
# The GPU check, as one short script for a machine with a GPU (CuPy, NCCL and pytest
# installed; lmdb may come as a wheel in .whl/). Prints the results table last.
#
#   bash bench/gpu_check.sh [OUTDIR]
#
# 1. builds and installs nccltree (no build isolation, no dependency downloads);
# 2. runs every test marked gpu / multi_gpu (the CUDA backend, kernels, collectives with
#    logical ranks sharing a GPU, NCCL where there are two GPUs or more);
# 3. a short all_reduce sweep on logical ranks of GPU 0 and a short training run.
set -uo pipefail
out=${1:-${OUT:-/tmp/nccltree-gpu}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
nvidia-smi -L | tee "$out/gpus.txt"

python3 -m pytest -q -m "gpu or multi_gpu" -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" | tail -15
tests=$(tail -1 "$out/gpu_tests.txt")

python3 -m nccltree.cli.bench collectives --devices gpu:0,0 --algorithm tree,ring,direct \
    -b 8 -e 256M -f 8 -n 20 -w 5 --json "$out/allreduce_gpu00.json" > "$out/allreduce_gpu00.txt" 2>&1
ngpu=$(nvidia-smi -L | wc -l)
if [[ $ngpu -ge 2 ]]; then
    python3 -m nccltree.cli.bench collectives --devices gpu:all --algorithm tree,ring,direct,nccl \
        -b 8 -e 256M -f 8 -n 20 -w 5 --json "$out/allreduce_gpuall.json" > "$out/allreduce_gpuall.txt" 2>&1
fi
python3 -m nccltree.cli.train --devices gpu:0 --iters 200 --quiet > "$out/train.txt" 2>&1

echo
echo "== GPU check"
echo "tests:     $tests"
grep -E "^ +268435456|^ +33554432" "$out/allreduce_gpu00.txt" | sed 's/^/gpu:0,0   /'
[[ -f "$out/allreduce_gpuall.txt" ]] && grep -E "^ +268435456" "$out/allreduce_gpuall.txt" | sed 's/^/gpu:all   /'
tail -1 "$out/train.txt" | sed 's/^/train:     /'
