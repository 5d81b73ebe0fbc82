"""Small elementwise building blocks: RMSNorm, SiLU-and-mul, rotary embedding.

On CPU (where :mod:`rtp.kernels.cpu_ops` builds) each runs as one fused C++ pass;
the torch code below is the reference for it and the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp.errors import ModelShapeError
from rtp.kernels import cpu_ops


def _on_cpu(x: torch.Tensor) -> bool:
    """True where the fused CPU kernels serve ``x`` (a CPU tensor, and the kernels built)."""
    return x.device.type == "cpu" and cpu_ops.available()


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same dtypes only: with an fp32 weight the reference promotes its output to fp32.
        if _on_cpu(x) and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: a decoder layer's residual add and the norm after it, one C++
        pass on CPU (the sum rounded to the activation dtype, as torch adds)."""
        if (_on_cpu(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1
                and self.weight.dtype == x.dtype == residual.dtype):
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return self(total), total

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch computation (what the CPU kernel matches)."""
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same numbers
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x`` is ``[..., 2 * d]`` = gate ‖ up: the C++ kernel on CPU, else torch."""
    if _on_cpu(x) and x.dim() == 2 and x.stride(-1) == 1:
        return cpu_ops.silu_and_mul(x)
    return SiluAndMul.reference(x)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = gate ‖ up (:func:`silu_and_mul`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    @staticmethod
    def reference(x: torch.Tensor) -> torch.Tensor:
        """The torch computation (what the CPU kernel matches)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_parameters(hf_config) -> tuple[str, dict]:  # noqa: ANN001 - a transformers PretrainedConfig
    """The config's RoPE variant and its parameters (``rope_theta``, a scaling's ``factor`` ...), from
    transformers 5's ``rope_parameters`` or transformers 4's ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params.get("rope_type", params.get("type", "default")) or "default", params


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of the config's RoPE variant.

    Works with both transformers 4 (``rope_theta``/``rope_scaling``) and 5
    (``rope_parameters``). Static variants only: "dynamic" and "longrope"
    change with the sequence length and are refused with a clear error.
    """
    rope_type, params = rope_parameters(hf_config)
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv_freq.float(), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ModelShapeError(
            f"rope_type={rope_type!r} is not supported (it depends on the sequence length); "
            "supported: default, linear, yarn, llama3"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelShapeError(f"unknown rope_type={rope_type!r}; supported: default, linear, yarn, llama3")
    try:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    except TypeError:  # transformers 5 dropped the device argument
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as HF Qwen3) with a cos/sin cache."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, scale: float) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))  # [max_positions, head_dim // 2]
        # Registered as buffers so .to(device) moves them; not in the state dict.
        self.register_buffer("cos", (freqs.cos() * scale), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] -> contiguous q, k
        if (_on_cpu(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and q.stride(1) == q.shape[2]
                and k.stride(1) == k.shape[2] and self.cos.dtype == torch.float32):
            return cpu_ops.rope(q, k, self.cos, self.sin, positions)  # one C++ pass (~20 torch ops otherwise)
        return self.reference(positions, q, k)

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch computation (what the CPU kernel matches)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                 rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of ``q [T, Hq, D]`` and ``k [T, Hkv, D]``, then the rotary embedding."""
    if (_on_cpu(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and q_norm.weight.dtype == q.dtype
            and k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps and rotary.cos.dtype == torch.float32):
        return cpu_ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, rotary.cos, rotary.sin, positions,
                                    q_norm.eps)
    return rotary.reference(positions, q_norm.reference(q), k_norm.reference(k))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
