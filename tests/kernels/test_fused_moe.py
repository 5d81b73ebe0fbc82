"""The fused Triton MoE equals the torch path (Triton interpreter on CPU; on CUDA in gpu_check.sh),
and the torch path equals transformers' Qwen3-MoE experts without looping over idle experts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import rtp.kernels.fused_moe as fm
from tests.kernels.fused_moe_cases import check_kernels
from tests.utils import REPO


@pytest.mark.timeout(300)
def test_triton_fused_moe_matches_torch_path_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.fused_moe_cases", "--device", "cpu"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 11 fused-MoE checks" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_fused_moe_matches_torch_path_on_cuda():
    assert check_kernels("cuda") == 10
    assert check_kernels("cuda", torch.bfloat16) == 10


def test_torch_path_matches_transformers_experts_and_skips_idle_experts(monkeypatch):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=2)
    hf = Qwen3MoeExperts(cfg)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    x = torch.randn(11, 32)
    ids = torch.randint(0, 3, (11, 2)) * 5  # only experts 0, 5 and 10 are used
    weights = torch.rand(11, 2)
    calls = []

    def counting_linear(inp, w, b=None):
        calls.append(1)
        return F.linear(inp, w, b)

    monkeypatch.setattr(fm, "F", type("F", (), {"linear": staticmethod(counting_linear), "silu": F.silu}))
    got = fm.fused_moe_reference(x, hf.gate_up_proj.data, hf.down_proj.data, weights, ids)
    with torch.no_grad():
        want = hf(x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    used = len(set(ids.flatten().tolist()))
    assert len(calls) == 2 * used, f"{len(calls)} matmuls for {used} busy experts of 16"
