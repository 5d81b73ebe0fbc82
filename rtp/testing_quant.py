"""Quantized copies of the tiny test checkpoints (:mod:`rtp.testing`): Qwen's FP8 blocks and AutoAWQ GEMM.

Both read a float checkpoint written by :func:`rtp.testing.make_tiny_qwen3` and write a new folder
with the same config (plus its ``quantization_config``), tokenizer and non-projection tensors.

- :func:`write_fp8_checkpoint`: every attention, MLP and expert projection as ``float8_e4m3fn``
  with a bf16 ``weight_scale_inv`` per 128 x 128 block (as Qwen's FP8 releases); the rest bf16.
  Each block is first scaled by its own random power of two in [1/2, 2], so that neighbouring
  blocks have clearly different scales: a scale applied to the wrong block changes the logits.
  Optionally also a float64 reference checkpoint of ``q x scale`` (blocks of 128 from the first
  row and column, the last one partial). transformers 5 dequantizes FP8 on CPU only where every
  dimension is a multiple of the block (it derives the block from ``rows // scale_rows``, so a
  192-row projection gets 96-row blocks); the reference serves the shapes where it does not.
- :func:`write_awq_checkpoint`: the projections as AutoAWQ's 4-bit GEMM tensors (asymmetric,
  groups of 128 inputs, packed from the format's description: nibble ``i`` of each int32 holds
  column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight); the rest fp16. It also writes a float64
  reference checkpoint whose projections are ``(q - z) * s`` computed from the integers before
  packing, so a test can compare with transformers running the dequantized model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Projections a quantized Qwen3 checkpoint stores quantized (the router mlp.gate stays in bf16/fp16).
PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _read(src: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            weights |= {k: st.get_tensor(k) for k in st.keys()}
    return weights


def _copy_configs(src: Path, dst: Path, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def fp8_block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (``float8_e4m3fn [N, K]``, bf16 ``scale_inv [ceil(N/b), ceil(K/b)]``), W ~ q x scale."""
    n, k = w.shape
    bn, bk = -(-n // block), -(-k // block)
    padded = torch.zeros(bn * block, bk * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(bn, block, bk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [bn, bk]
    scale = (amax / FP8_MAX).to(torch.bfloat16)  # the scale as stored
    q = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bn * block, bk * block)[:n, :k].contiguous(), scale


def _expand(blocks: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """``[ceil(N/b), ceil(K/b)]`` -> ``[N, K]``: each block's value over its rows and columns."""
    return blocks.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def write_fp8_checkpoint(src: str | Path, dst: str | Path, reference: str | Path | None = None, seed: int = 0,
                         block: int = 128) -> Path:
    """Write ``src`` (a float tiny checkpoint) in Qwen's FP8 block format into ``dst``; returns ``dst``.

    ``reference``: also write there the float64 dequantized checkpoint (see the module docstring).
    """
    src, dst = Path(src), Path(dst)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if not PROJECTION.search(name):
            out[name] = t.to(torch.bfloat16).contiguous()
            ref[name] = out[name].double()
            continue
        n, k = t.shape
        jitter = 2.0 ** (torch.rand(-(-n // block), -(-k // block), generator=g) * 2 - 1)  # in [1/2, 2]
        q, scale = fp8_block_quantize(t.float() * _expand(jitter, (n, k), block), block)
        out[name], out[name + "_scale_inv"] = q, scale
        ref[name] = q.double() * _expand(scale.double(), (n, k), block)  # [N, K]
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_configs(src, dst, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [block, block]})
    if reference is not None:
        _write_reference(src, Path(reference), ref)
    return dst


def _write_reference(src: Path, reference: Path, weights: dict[str, torch.Tensor]) -> None:
    """A float64 checkpoint of ``weights`` with ``src``'s config (no quantization_config) and tokenizer."""
    reference.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    _copy_configs(src, reference, {})
    config = json.loads((reference / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = config["dtype"] = "float64"
    (reference / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, C]`` of 4-bit values -> int32 ``[R, C/8]`` in AutoAWQ's GEMM nibble order."""
    r, c = values.shape
    packed = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        packed |= values[:, col::8].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # the same 32 bits, as a signed int32
    return packed.to(torch.int32)


def awq_quantize(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (q int ``[K, N]``, zeros int ``[K/g, N]``, fp16 scales ``[K/g, N]``), asymmetric 4-bit."""
    wt = w.double().t().reshape(w.shape[1] // group, group, w.shape[0])  # [K/g, g, N]
    lo, hi = wt.amin(dim=1), wt.amax(dim=1)  # [K/g, N]
    scales = ((hi - lo).clamp(min=1e-8) / 15).to(torch.float16)
    s = scales.double()
    zeros = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(wt / s[:, None] + zeros[:, None]).clamp(0, 15)  # [K/g, g, N]
    return q.reshape(w.shape[1], w.shape[0]).long(), zeros.long(), scales


def write_awq_checkpoint(src: str | Path, dst: str | Path, reference: str | Path, group: int = 128) -> Path:
    """Write ``src`` as an AutoAWQ GEMM checkpoint into ``dst`` and its float64 dequantization into ``reference``."""
    src, dst, reference = Path(src), Path(dst), Path(reference)
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if not PROJECTION.search(name):
            out[name] = t.to(torch.float16).contiguous()
            ref[name] = out[name].double()
            continue
        q, zeros, scales = awq_quantize(t, group)
        stem = name.removesuffix(".weight")
        out[stem + ".qweight"], out[stem + ".qzeros"] = awq_pack(q), awq_pack(zeros)
        out[stem + ".scales"] = scales.contiguous()
        # W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n], in float64 from the unpacked integers
        z, s = zeros.repeat_interleave(group, 0), scales.double().repeat_interleave(group, 0)  # [K, N]
        ref[name] = ((q - z).double() * s).t().contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_configs(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                             "version": "gemm", "modules_to_not_convert": None})
    _write_reference(src, reference, ref)
    return dst
