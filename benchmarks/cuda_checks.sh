#!/usr/bin/env bash
# Every CUDA check of the output head in one run, for a lent GPU machine (benchmarks/RESULTS.md records
# what it gave): the CUDA tests, first with the machine's packages, then with the peers' kernels
# (Liger-Kernel, cut-cross-entropy) importable; then the head benchmarks at the shape.
#
#   bash benchmarks/cuda_checks.sh [PEERS_DIR]     # logs under $OUT (default ./cuda_checks)
#
# PEERS_DIR: where liger_kernel and cut_cross_entropy are installed (pip install --target), if they are
# not installed in the environment; it is put on PYTHONPATH for the second half only.
set -u
out=${OUT:-cuda_checks}
peers=${1:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shape=${SHAPE:-8192x4096x128256}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null
} >"$out/env.txt" 2>&1

step() { # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local t0=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}

step tests 170 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 150 \
    tests/heads tests/parallel/test_cuda.py tests/models/test_hf_precision.py
if [ -n "$peers" ]; then
    export PYTHONPATH="$PYTHONPATH:$peers"
fi
step tests_peers 90 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 80 \
    tests/heads/test_cuda.py tests/heads/test_cuda_peers.py
step fused_head 180 python3 benchmarks/fused_head.py --device cuda --dtype bfloat16 --shapes "$shape" \
    --repeats 3 --variants naive naive_entropy matmul3 chunked_ce blocked_ce blocked_entropy \
    chunked_entropy liger_ce liger_native liger_scaled_entropy cce cce_ce cce_native
step fused_head_small_blocks 60 python3 benchmarks/fused_head.py --device cuda --dtype bfloat16 \
    --shapes "$shape" --repeats 3 --chunk-size 512 --variants blocked_ce blocked_entropy
step head_profile 60 python3 benchmarks/head_profile.py --device cuda --dtype bfloat16 --shape "$shape" \
    --variants blocked_ce blocked_entropy --rows 12
step head_memory 60 python3 benchmarks/head_memory.py --device cuda --shape "$shape" --chunk-size 1024 \
    --backends auto --dtypes bfloat16 float32
