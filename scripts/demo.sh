#!/usr/bin/env bash
# Set up a local virtualenv (first run only) and generate a few completions with
# the small shipped Qwen3 (trained on Shakespeare, rtp/assets/) on two CPU ranks. Extra arguments go to launch/generate.py, e.g. a tiny
# Qwen3-MoE: python scripts/make_tiny_qwen3.py /tmp/tiny-moe --moe && scripts/demo.sh --model /tmp/tiny-moe
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RTP_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)  # noise from this machine's pip config
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/torchrun" --standalone --nproc-per-node "${NPROC:-2}" launch/generate.py --config configs/cpu.yaml "$@"
