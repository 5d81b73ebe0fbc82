"""rtp's rotary embedding against HF's Qwen3 rotary embedding, for each supported RoPE variant."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from rtp.errors import ModelShapeError
from rtp.model.ops import RotaryEmbedding, rope_inv_freq

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
]


def config(scaling):
    return Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=1024, rope_theta=50000.0, rope_scaling=scaling)


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_rotary_matches_hf(scaling):
    cfg = config(scaling)
    inv_freq, scale = rope_inv_freq(cfg, 16)
    ours = RotaryEmbedding(16, 1024, inv_freq, scale)
    positions = torch.tensor([0, 1, 7, 255, 256, 1000])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    q_rot, k_rot = ours(positions, q, k)

    cos, sin = Qwen3RotaryEmbedding(cfg)(q, positions.unsqueeze(0))  # [1, T, D]
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    assert torch.allclose(q_rot, q * cos + rotate_half(q) * sin, atol=1e-5)
    assert torch.allclose(k_rot, k * cos + rotate_half(k) * sin, atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=lambda s: s["rope_type"])
def test_rotary_builds_on_another_device(scaling):
    # The frequencies come from the CPU; the cache is built on the model's device (meta stands in for CUDA).
    inv_freq, scale = rope_inv_freq(config(scaling), 16)
    with torch.device("meta"):
        rot = RotaryEmbedding(16, 1024, inv_freq, scale)
    assert rot.cos.device.type == "meta"


def test_sequence_length_dependent_rope_is_refused():
    with pytest.raises(ModelShapeError, match="dynamic"):
        rope_inv_freq(config({"rope_type": "dynamic", "factor": 2.0}), 16)
