#!/usr/bin/env bash
# Every CUDA check of the output head in one run, for a lent GPU machine (benchmarks/RESULTS.md records
# what it gave): the CUDA tests, first with the machine's packages, then with the peers' kernels
# (Liger-Kernel, cut-cross-entropy) importable; then the head benchmarks at the shape.
#
#   bash benchmarks/cuda_checks.sh [PEERS_DIR] [STEPS]   # logs under $OUT (default ./cuda_checks)
#
# PEERS_DIR: where liger_kernel and cut_cross_entropy are installed (pip install --target), if they are
# not installed in the environment; it is put on PYTHONPATH after the first step. STEPS: the steps to run
# (default: all), e.g. "tests fused_head".
set -u
out=${OUT:-cuda_checks}
peers=${1:-}
steps=${2:-"tests tests_peers fused_head head_profile fused_head_rest liger_fallback head_memory"}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shape=${SHAPE:-8192x4096x128256}
bench=(python3 benchmarks/fused_head.py --device cuda --dtype bfloat16 --shapes "$shape" --repeats 3)

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null
} >"$out/env.txt" 2>&1

step() { # name, seconds, command...: runs when STEPS names it
    local name=$1 seconds=$2
    shift 2
    case " $steps " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}

step tests 150 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 120 \
    tests/heads tests/parallel/test_cuda.py tests/models/test_hf_precision.py
if [ -n "$peers" ]; then
    export PYTHONPATH="$PYTHONPATH:$peers"
fi
step tests_peers 60 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 50 \
    tests/heads/test_cuda.py tests/heads/test_cuda_peers.py
step fused_head 150 "${bench[@]}" --variants naive naive_entropy matmul3 blocked_ce blocked_entropy chunked_ce \
    liger_native cce_ce cce_native
step head_profile 40 python3 benchmarks/head_profile.py --device cuda --dtype bfloat16 --shape "$shape" \
    --variants blocked_ce blocked_entropy --rows 12
step fused_head_rest 120 "${bench[@]}" --variants chunked_entropy liger_ce cce
# Liger's scaled CE runs its SM90 kernel on compute capability 9.0 only with liger-kernel[cutedsl]; where
# that is missing, its PyTorch fallback is measured by reporting capability 8.0 to every process
mkdir -p /tmp/sm80 && printf 'import torch\ntorch.cuda.get_device_capability = lambda *a, **k: (8, 0)\n' \
    >/tmp/sm80/sitecustomize.py
step liger_fallback 90 env PYTHONPATH="/tmp/sm80:$PYTHONPATH" bash -c \
    "python3 -m pytest -m cuda -q -rs -p no:cacheprovider tests/heads/test_cuda_peers.py -k liger_scaled \
    && ${bench[*]} --variants liger_scaled_entropy"
step head_memory 60 python3 benchmarks/head_memory.py --device cuda --shape "$shape" --chunk-size 1024 \
    --backends auto --dtypes bfloat16 float32
