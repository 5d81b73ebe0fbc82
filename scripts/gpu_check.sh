#!/usr/bin/env bash
# GPU checks in one go: the gpu-marked tests, a 2-rank NCCL smoke run if 2+ GPUs,
# and a short rtp-vs-HF benchmark. Meant for a CUDA machine with torch installed;
# flash-attn is used when importable (pip install -e '.[gpu]').
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
"$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" || echo "flash-attn: not installed (torch attention path)"
rc=0
"$PY" -m pytest -q -m gpu tests/model/test_gpu.py -ra || rc=1
"$PY" -m pytest -q tests/model/test_kv_store.py || rc=1
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 launch/generate.py \
        --config configs/2xH100.yaml --max-tokens 16 || rc=1
fi
"$PY" scripts/bench.py --device cuda --preset small --num-prompts 64 --max-tokens 128 || rc=1
exit $rc
