#!/usr/bin/env bash
# Every CUDA check of the output head in one run, for a lent GPU machine (benchmarks/RESULTS.md records
# what it gave): the GEMMs of one vocabulary block, the head against the naive head and the peers' kernels
# (Liger-Kernel, cut-cross-entropy) at the shape, the CUDA tests, the head's memory and a profile.
#
#   bash benchmarks/cuda_checks.sh [CCE_DIR] [LIGER_DIR] [STEPS]   # logs under $OUT (./cuda_checks)
#
# CCE_DIR, LIGER_DIR: where cut_cross_entropy and liger_kernel are installed (pip install --target), if
# they are not installed in the environment: cut-cross-entropy is importable in every step, Liger-Kernel
# in the `liger` step only (with it, `auto` takes Liger's kernel for the plain CE, which other tests
# exclude). STEPS: the steps to run (default: all but the whole training steps), e.g. "tests fused_head".
#
# The whole training step of a 1B Llama (benchmarks/train_step.py: this package with and without
# use_liger_kernel, HF's loss, HF + Liger-Kernel, each variant in its own process, at most 100 s each;
# Liger-Kernel from LIGER_DIR) runs as the named steps `train_step` (one GPU, about 190 s on an H100) and
# `train_step_fsdp` (FSDP2 over one process); rows that finished are in $OUT/train_step*.json even after a
# timeout, each variant's stderr in $OUT/logs. A machine without the package's dependencies takes them as
# wheels in LIGER_DIR (jsonargparse, docstring_parser, typeshed_client, simpleeval, liger_kernel), e.g.
#   bash benchmarks/cuda_checks.sh "" /tmp/site "train_step train_step_fsdp"
# `per_token_time` and `per_token_memory` (named only too) measure `chunked` against `blocked` for the
# per-token outputs of an fp32 weight (`auto` takes `blocked`: measured on an H100, benchmarks/RESULTS.md).
set -u
out=${OUT:-cuda_checks}
cce=${1:-}
liger=${2:-}
steps=${3:-"block_gemm fused_head tests liger head_memory head_profile"}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shape=${SHAPE:-8192x4096x128256}
if [ -n "$cce" ]; then
    export PYTHONPATH="$PYTHONPATH:$cce"
fi
bench=(python3 benchmarks/fused_head.py --device cuda --dtype bfloat16 --shapes "$shape" --repeats 3)

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null
} >"$out/env.txt" 2>&1

step() { # name, seconds, command...: runs when STEPS names it (its log: $LOG.log, else name.log)
    local name=$1 seconds=$2
    shift 2
    case " $steps " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout "$seconds" "$@" >"$out/${LOG:-$name}.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}

step block_gemm 40 python3 benchmarks/block_gemm.py
step fused_head 150 env PYTHONPATH="$PYTHONPATH:$liger" "${bench[@]}" --variants naive naive_entropy matmul3 blocked_ce blocked_ce_low_logits blocked_entropy chunked_ce \
    liger_native cce_native
step tests 170 python3 -m pytest -m cuda -q -rs -p no:cacheprovider --timeout 150 -n 4 \
    tests/heads tests/parallel/test_cuda.py tests/models/test_hf_precision.py tests/test_distributed.py
# Liger's scaled CE runs its SM90 kernel on compute capability 9.0 only with liger-kernel[cutedsl]; where
# that is missing, the adapter is tested on Liger's PyTorch fallback by reporting capability 8.0. That
# report reaches every Triton build of the step: Liger's plain-CE kernels and the head's compiled kernels
# are then built for sm_80 and cannot load on a Hopper GPU (the plain-CE `liger` tests fail there, and the
# head's kernels switch to their eager passes): on Hopper only the `liger_scaled` results of this step count
mkdir -p /tmp/sm80 && printf 'import torch\ntorch.cuda.get_device_capability = lambda *a, **k: (8, 0)\n' \
    >/tmp/sm80/sitecustomize.py
step liger 90 env PYTHONPATH="/tmp/sm80:$PYTHONPATH:$liger" python3 -m pytest -m cuda -q -rs \
    -p no:cacheprovider tests/heads/test_cuda_peers.py tests/heads/test_cuda.py -k liger
step head_memory 60 python3 benchmarks/head_memory.py --device cuda --backends auto
step head_profile 40 python3 benchmarks/head_profile.py --device cuda --dtype bfloat16 --shape "$shape" \
    --variants blocked_ce chunked_ce --rows 10
train=(python3 benchmarks/train_step.py --device cuda --steps 4 --warmup 2 --variant-timeout 100 --logs "$out/logs")
step train_step 400 env PYTHONPATH="$PYTHONPATH:$liger" "${train[@]}" --json "$out/train_step.json"
step train_step_fsdp 400 env PYTHONPATH="$PYTHONPATH:$liger" "${train[@]}" --fsdp --json "$out/train_step_fsdp.json"
# The blocked head's block width against the whole step (the SFT step with Liger-Kernel's decoder kernels,
# HF + Liger-Kernel in the first run): --chunk-size sets it, V_b = chunk · V / (n + 2 D) rounded down to
# 128 rows (1024: 10624 rows at 8192 tokens and D = 2048; 256: 2560; 128: 1280), with the head's fp32
# logits (auto) and its bf16 ones (low_logits: 2 bytes per logit of a block instead of 3, and about 14 bytes
# of traffic per logit and step instead of 22). Named only. Each variant profiles one more step after the
# timed ones ($out/profiles/lit_sft_liger_chunk<c>[_low_logits].txt and hf_liger.txt: kernels by device
# time). WIDTHS and PRECISIONS choose fewer runs (about 40 s each on an H100).
for c in ${WIDTHS:-1024 512 256 128}; do
    for p in ${PRECISIONS:-auto low_logits}; do
        variants=(lit_sft_liger)
        [ "$c$p" = 1024auto ] && variants+=(hf_liger)
        LOG=train_step_chunk${c}_$p step train_step_widths 150 env PYTHONPATH="$PYTHONPATH:$liger" "${train[@]}" \
            --chunk-size "$c" --head-matmul-precision "$p" --variants "${variants[@]}" \
            --json "$out/train_step_chunk${c}_$p.json" --logs "$out/logs/chunk${c}_$p" --profile "$out/profiles"
    done
done
step per_token_time 150 python3 benchmarks/fused_head.py --device cuda --dtype float32 --shapes "$shape" --repeats 3 \
    --variants matmul3 chunked blocked chunked_entropy blocked_entropy
step per_token_memory 60 python3 benchmarks/head_memory.py --device cuda --backends chunked blocked --dtypes float32 \
    --paths per_token
