"""The FP8 block and AWQ GEMMs equal float64 dequantized references (Triton interpreter on CPU; on CUDA
in gpu_check.sh), shards cut inside a 128-block included (tests/kernels/quant_gemm_cases.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.quant_gemm_cases import check_kernels
from tests.utils import REPO


@pytest.mark.timeout(120)
def test_quantized_gemms_match_float64_references_under_interpreter():
    # float8_e4m3fn loads, stores and FP8 tl.dot run in triton 3.9's interpreter; two of its casts do not
    # (worked around or left out, see quant_gemm_cases.INTERPRETER_DTYPES and the quantization kernel).
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.quant_gemm_cases", "--device", "cpu"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 56 quantized-GEMM checks on cpu" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantized_gemms_match_float64_references_on_cuda():
    w8a8 = torch.cuda.get_device_capability() >= (8, 9)
    # quantization; per dtype: W8A16 and AWQ GEMMs, FP8 MoE, w8a8 GEMMs and MoE; 6 layers per dtype
    assert check_kernels("cuda", w8a8=w8a8) == 4 + 3 * (5 + 4 + 1 + (6 if w8a8 else 0)) + 3 * 6
