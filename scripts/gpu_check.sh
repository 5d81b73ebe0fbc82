#!/usr/bin/env bash
# GPU checks in one go, within about 5 minutes, on a CUDA machine that has at least torch, triton,
# transformers, safetensors and xxhash (flash-attn and pytest optional, no network needed):
#   1. Triton paged attention on CUDA, no interpreter: kernels vs torch references (fp32 and bf16),
#      the layer and the whole model on the triton backend, CUDA-graph replay, kernel timings
#      (python -m tests.kernels.paged_attention_cases: needs no pytest)
#   1b. fused MoE on CUDA: Triton kernels vs torch path, CUDA-graph replay, a tiny Qwen3-MoE model,
#      timings of one Qwen3-30B-A3B MoE layer (python -m tests.kernels.fused_moe_cases)
#   1c. FP8 KV cache on CUDA: the Triton store byte for byte against the torch reference, paged attention on
#      an fp8 cache (fp32 and bf16 queries) against float64, the model on the triton backend against the torch
#      backend, both with kv_cache_dtype fp8_e4m3 (python -m tests.kernels.fp8_kv_cases)
#   1d. quantized GEMMs on CUDA: FP8 per-token-group quantization, w8a8 (sm89+) and W8A16 block matmuls,
#      AWQ int4, the FP8 fused MoE and packed TP-shard layers vs float64 dequantized references, and tiny
#      FP8-MoE and AWQ models (eager and CUDA graphs) vs the CPU path
#      (python -m tests.kernels.quant_gemm_cases)
#   2. the gpu-marked tests (pytest -m gpu over the files that hold them), when pytest is installed
#   3. a 2-rank NCCL smoke run, when there are 2+ GPUs
#   4. a short benchmark (scripts/bench.py --quick); its failure is reported, not fatal
# Writes a markdown table (check, result, seconds) to $OUT/gpu_check.md if $OUT is set, else to
# gpu_check.md in the repository root (gitignored); with $OUT, every check's log too (gpu_check_logs.tar.gz).
# Exits non-zero when a check in 1-3 fails.
#
# scripts/gpu_check.sh --fake needs no GPU: it traces the CUDA path with fake CUDA tensors
# (python -m rtp.fake_cuda: dense and MoE Qwen3, bf16, TP 1 and 2 on torch.distributed's fake
# process group, the triton and torch attention backends, FP8/AWQ checkpoints (their projections and experts
# kept packed for the quantized kernels; the FP8 MoE also expert-parallel and on sm80 GPUs), the FP8 KV cache
# with checkpoint scales; start-up, prefill, mixed and decode steps,
# CUDA-graph capture and padded replay, the sampler), prints one row per (model, TP, backend, stage),
# writes it to gpu_check_fake.md ($OUT or the repository root) and exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON, else the venv scripts/test.sh sets up (when there is one), else python3.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = --fake ]; then
    [ -n "${OUT:-}" ] && mkdir -p "$OUT"
    exec "$PY" -m rtp.fake_cuda --out "${OUT:+$OUT/}gpu_check_fake.md"
fi
REPORT="${OUT:+$OUT/}gpu_check.md"
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-290}))  # every check's time limit is cut to what is left
rc=0
ROWS=()

# check NAME LIMIT_S [--tolerate] CMD...: run CMD under a time limit, log it, add a table row.
check() {
    local name=$1 limit=$2 tolerate=0
    shift 2
    if [ "$1" = --tolerate ]; then tolerate=1; shift; fi
    local left=$((DEADLINE - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        ROWS+=("| $name | SKIP (out of time) | 0 |")
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    local log="$LOGS/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log" t0=$EPOCHREALTIME status result
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    local secs
    secs=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $t0 }")
    if [ "$status" -eq 0 ]; then
        result=PASS
    elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        result="FAIL (timed out after ${limit}s)"
    else
        result="FAIL (exit $status)"
    fi
    if [ "$status" -ne 0 ]; then
        if [ "$tolerate" -eq 1 ]; then
            result="$result, tolerated"
            echo "=== $name failed (exit $status): reported, not counted as a failure"
        else
            rc=1
        fi
    fi
    ROWS+=("| $name | $result | $secs |")
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
ENV_LINE="$("$PY" -c '
import importlib.util, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "not installed"
fa = "installed" if importlib.util.find_spec("flash_attn") else "not installed (triton attention)"
pt = "installed" if importlib.util.find_spec("pytest") else "not installed"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
print(f"{gpu} x{torch.cuda.device_count()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"triton {tv}; flash-attn {fa}; pytest {pt}")
' 2>&1)"
echo "$ENV_LINE"
NUM_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"

if [ "$NUM_GPUS" -ge 1 ]; then
    check "triton paged attention on CUDA (kernels, layer, model, graphs)" 120 \
        "$PY" -m tests.kernels.paged_attention_cases --device cuda --bench
    check "fused MoE on CUDA (kernels fp32/bf16, CUDA graph, tiny Qwen3-MoE model)" 120 \
        "$PY" -m tests.kernels.fused_moe_cases --device cuda --bench
    check "FP8 KV cache on CUDA (store, paged attention vs float64, tiny model)" 90 \
        "$PY" -m tests.kernels.fp8_kv_cases --device cuda
    check "quantized GEMMs on CUDA (FP8 w8a8/W8A16, AWQ, FP8 fused MoE, TP-shard layers, tiny models)" 120 \
        "$PY" -m tests.kernels.quant_gemm_cases --device cuda
    GPU_TESTS="tests/model/test_attention.py tests/kernels/test_paged_attention.py tests/runtime/test_cuda_graphs.py tests/kernels/test_fused_moe.py tests/kernels/test_quant_gemm.py"
    if "$PY" -c "import pytest" 2>/dev/null; then
        # shellcheck disable=SC2086 # one word per file
        check "gpu-marked tests (pytest -m gpu: attention, paged attention, CUDA graphs, fused MoE, quantized GEMMs)" 120 \
            "$PY" -m pytest -q -m gpu $GPU_TESTS -ra -p no:cacheprovider
    else
        ROWS+=("| gpu-marked tests (pytest -m gpu) | SKIP (pytest not installed; the triton checks above cover the same paths) | 0 |")
    fi
else
    ROWS+=("| GPU checks | FAIL (torch sees no CUDA GPU) | 0 |")
    rc=1
fi
if [ "$NUM_GPUS" -ge 2 ]; then
    check "2-rank NCCL generate" 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        launch/generate.py --config configs/2xH100.yaml --max-tokens 16
fi
check "benchmark (scripts/bench.py --device cuda --quick)" 90 --tolerate \
    "$PY" scripts/bench.py --device cuda --quick

{
    echo "# rtp GPU check"
    echo
    echo "$ENV_LINE"
    echo
    echo "| check | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    timings="$(grep -h '^bench ' "$LOGS"/*.log 2>/dev/null)"
    if [ -n "$timings" ]; then
        echo
        echo "Kernel timings (paged attention: bf16, 32 query / 8 KV heads, head_dim 128; fused MoE: one"
        echo "Qwen3-30B-A3B layer, bf16, 128 experts, top-8, hidden 2048, expert width 768):"
        echo
        echo "$timings" | sed 's/^/- /'
    fi
} > "$REPORT"
if [ -n "${OUT:-}" ]; then  # every check's whole log comes back with the report
    tar czf "$OUT/gpu_check_logs.tar.gz" -C "$LOGS" . 2>/dev/null || true
fi
echo "=== report: $REPORT"
cat "$REPORT"
exit $rc
