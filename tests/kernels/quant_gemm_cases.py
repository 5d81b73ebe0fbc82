"""Checks of the quantized GEMMs (:mod:`rtp.kernels.quant_gemm`) against float64 dequantized references,
shared by the pytest tests and scripts/gpu_check.sh (no pytest needed).

    TRITON_INTERPRET=1 python -m tests.kernels.quant_gemm_cases --device cpu   # Triton interpreter
    python -m tests.kernels.quant_gemm_cases --device cuda                     # on a GPU

Every weight is cut from a full checkpoint-shaped tensor the way a TP shard is: sizes that are not
multiples of 128, output rows that start inside a 128-block (a column-parallel shard) and input
columns that start inside one (a row-parallel shard: ``k_offset``). The reference is the full
weight dequantized in float64 (``q x block scale``, ``(q - z) x s``), then sliced.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from rtp.distributed.parallel import ParallelState
from rtp.kernels import quant_gemm as qg
from rtp.kernels.fused_moe import Fp8Experts, fused_moe_fp8, fused_moe_reference
from rtp.model.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rtp.model.quant import AwqFormat, Fp8BlockFormat, QuantFormat, QuantLinearMethod
from rtp.model.quant.base import PACKED_QUANT
from rtp.testing_quant import awq_pack, awq_quantize, fp8_block_quantize

# (full N, full K, rows r0:r1, input columns c0:c1, tokens M)
FP8_CASES = [
    (256, 384, (0, 256), (0, 384), 5),  # whole blocks
    (200, 300, (0, 200), (0, 300), 7),  # N and K not multiples of 128
    (384, 256, (96, 288), (0, 256), 3),  # rows 96..287: a column shard starting inside a block
    (256, 384, (0, 256), (192, 384), 16),  # columns 192..383: a row shard, k_offset 64
    (192, 320, (64, 160), (96, 288), 1),  # both, one token (decode)
]
# AWQ: N a multiple of 8 and K of 128 (the format's own limits); shards cut N by 8s, K anywhere.
AWQ_CASES = [
    (128, 256, (0, 128), (0, 256), 5),
    (192, 384, (64, 128), (0, 384), 9),  # an N shard
    (64, 384, (0, 64), (192, 384), 16),  # a K shard starting inside a group: k_offset 64
    (136, 384, (8, 136), (96, 288), 1),  # N not a multiple of the column block, both cut
]


def _expand_blocks(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return blocks.repeat_interleave(qg.GROUP, 0)[:n].repeat_interleave(qg.GROUP, 1)[:, :k]


def fp8_shard(full_n: int, full_k: int, rows: tuple[int, int], cols: tuple[int, int], g: torch.Generator,
              device: str) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(fp8 weight, row scales [n, G], k_offset, float64 reference weight) of one shard of a random weight."""
    w = torch.randn(full_n, full_k, generator=g) * 0.05
    q, scale = fp8_block_quantize(w)  # [N, K] fp8, [ceil(N/128), ceil(K/128)] bf16
    ref = q.double() * _expand_blocks(scale.double(), full_n, full_k)  # [N, K]
    (r0, r1), (c0, c1) = rows, cols
    k_offset = c0 % qg.GROUP
    groups = qg.num_groups(c1 - c0, k_offset)
    row_scales = scale.float()[torch.arange(r0, r1) // qg.GROUP]  # [n, ceil(K/128)]: each row its block's
    shard_scale = row_scales[:, c0 // qg.GROUP : c0 // qg.GROUP + groups].contiguous()
    return (q[r0:r1, c0:c1].contiguous().to(device), shard_scale.to(device), k_offset,
            ref[r0:r1, c0:c1])


def awq_shard(full_n: int, full_k: int, rows: tuple[int, int], cols: tuple[int, int], g: torch.Generator,
              device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(qweight, qzeros, scales, k_offset, float64 reference weight) of one shard of a random AWQ weight."""
    groups_full = full_k // qg.GROUP
    q = torch.randint(0, 16, (full_k, full_n), generator=g)
    z = torch.randint(0, 16, (groups_full, full_n), generator=g)
    s = (torch.rand(groups_full, full_n, generator=g) * 0.01 + 0.002).to(torch.float16)
    zk = z.repeat_interleave(qg.GROUP, 0)
    sk = s.double().repeat_interleave(qg.GROUP, 0)
    ref = ((q - zk).double() * sk).t()  # [N, K]
    (r0, r1), (c0, c1) = rows, cols
    k_offset = c0 % qg.GROUP
    g0, g1 = c0 // qg.GROUP, -(-c1 // qg.GROUP)
    return (awq_pack(q[c0:c1, r0:r1]).to(device), awq_pack(z[g0:g1, r0:r1]).to(device),
            s[g0:g1, r0:r1].contiguous().to(device), k_offset, ref[r0:r1, c0:c1])


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """Max error relative to the reference's largest value (the outputs are sums of signed products)."""
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item()
    if not err <= rtol * scale:
        raise AssertionError(f"{what}: max error {err:.3g} exceeds {rtol} x {scale:.3g}")


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 1.5e-2  # fp32 sums; bf16/fp16 outputs (8/11-bit mantissas)


def check_quantize(device: str, g: torch.Generator) -> int:
    """The per-token-group quantization equals the torch reference, and dequantizes to within e4m3's step."""
    checks = 0
    for m, k, k_offset in ((5, 384, 0), (3, 200, 0), (16, 192, 64), (1, 100, 100)):
        x = torch.randn(m, k, generator=g).to(device)
        x[0, :17] = 0.0  # a run of zeros: in a group with others; (1, 100, 100): a whole group
        q, s = qg.quantize_fp8_groups(x, k_offset)
        q_ref, s_ref = qg.quantize_fp8_groups_reference(x.cpu(), k_offset)
        assert s.shape == (m, qg.num_groups(k, k_offset)), f"scales {list(s.shape)}"
        assert torch.equal(s.cpu(), s_ref), f"scales of ({m}, {k}, {k_offset}) differ from the torch reference"
        assert torch.equal(q.cpu().float(), q_ref.float()), f"fp8 values of ({m}, {k}, {k_offset}) differ"
        cols = torch.arange(k) + k_offset
        deq = q.cpu().double() * s.cpu().double()[:, cols // qg.GROUP]
        # e4m3 has 3 mantissa bits: each value within 2^-4 of itself, plus the smallest subnormal step
        bound = x.cpu().double().abs() * 2.0**-4 + s.cpu().double()[:, cols // qg.GROUP] * 2.0**-9
        assert ((deq - x.cpu().double()).abs() <= bound).all(), "dequantized activations off by more than e4m3's step"
        checks += 1
    return checks


def check_fp8(device: str, dtype: torch.dtype, g: torch.Generator, w8a8: bool) -> int:
    checks = 0
    for full_n, full_k, rows, cols, m in FP8_CASES:
        w, scale, k_offset, ref = fp8_shard(full_n, full_k, rows, cols, g, device)
        x = torch.randn(m, w.shape[1], generator=g).to(dtype).to(device)
        what = f"{'w8a8' if w8a8 else 'w8a16'} {dtype} N={full_n} K={full_k} rows={rows} cols={cols} M={m}"
        y = qg.fp8_block_linear(x, w, scale, k_offset, w8a8)
        assert y.shape == (m, w.shape[0]) and y.dtype == dtype, f"{what}: {y.dtype}{list(y.shape)}"
        if w8a8:
            xq, xs = qg.quantize_fp8_groups(x, k_offset)
            cols_k = torch.arange(x.shape[1]) + k_offset
            x_deq = xq.cpu().double() * xs.cpu().double()[:, cols_k // qg.GROUP]
            _close(y, x_deq @ ref.t(), _tolerance(dtype), what + " (vs its quantized activations)")
            _close(y, x.cpu().double() @ ref.t(), 0.1, what + " (vs the activations)")
        else:
            _close(y, x.cpu().double() @ ref.t(), _tolerance(dtype), what)
        checks += 1
    return checks


def check_awq(device: str, dtype: torch.dtype, g: torch.Generator) -> int:
    checks = 0
    for full_n, full_k, rows, cols, m in AWQ_CASES:
        qweight, qzeros, scales, k_offset, ref = awq_shard(full_n, full_k, rows, cols, g, device)
        x = torch.randn(m, cols[1] - cols[0], generator=g).to(dtype).to(device)
        y = qg.awq_linear(x, qweight, qzeros, scales, k_offset)
        what = f"awq {dtype} N={full_n} K={full_k} rows={rows} cols={cols} M={m}"
        assert y.shape == (m, rows[1] - rows[0]) and y.dtype == dtype, f"{what}: {y.dtype}{list(y.shape)}"
        _close(y, x.cpu().double() @ ref.t(), _tolerance(dtype), what)
        checks += 1
    return checks


def _fp8_tensors(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of ``w`` in Qwen's FP8 format and their float64 dequantization."""
    q, scale = fp8_block_quantize(w)
    return {"weight": q, "weight_scale_inv": scale}, q.double() * _expand_blocks(scale.double(), *w.shape)


def _awq_tensors(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of ``w`` in AutoAWQ's GEMM format and their float64 dequantization."""
    q, z, s = awq_quantize(w)
    ref = ((q - z.repeat_interleave(qg.GROUP, 0)).double() * s.double().repeat_interleave(qg.GROUP, 0)).t()
    return {"qweight": awq_pack(q), "qzeros": awq_pack(z), "scales": s}, ref


# (format, layer, the other size): rank 1 of 2 takes rows 192..383 of each 384-row projection (block 1 cut at
# row 64 of its 128), input columns 192..383 (k_offset 64), or, of q/k/v with 4 query and 2 KV heads of 64,
# q rows 128..255 and k/v rows 64..127 (the second half of block 0)
LAYER_CASES = [("fp8", "merged", 320), ("fp8", "row", 200), ("fp8", "qkv", 192), ("awq", "merged", 256),
               ("awq", "row", 64), ("awq", "qkv", 256)]


def check_layers(device: str, dtype: torch.dtype) -> int:
    """Packed quantized layers of rank 1 at TP 2, loaded through their weight loaders, equal the float64
    dequantized checkpoint's slice (the layers as a model builds them on ``device``; packing forced on CPU)."""
    g = torch.Generator().manual_seed(1)
    ps = ParallelState(rank=1, world_size=2, local_rank=1, device=torch.device(device))
    checks = 0
    for name, kind, size in LAYER_CASES:
        fmt: QuantFormat = Fp8BlockFormat() if name == "fp8" else AwqFormat()
        tensors = _fp8_tensors if name == "fp8" else _awq_tensors
        method = QuantLinearMethod(fmt, packed=True)
        with torch.device(device):  # the layer; the checkpoint tensors stay on the CPU (g is a CPU generator)
            layer: LinearBase
            if kind == "merged":  # gate/up of [384, size]: rows 192..383 of each
                layer = MergedColumnParallelLinear(size, [384, 384], ps, method=method)
            elif kind == "qkv":  # q [256, size], k and v [128, size]
                layer = QKVParallelLinear(size, 64, 4, 2, ps, method=method)
            else:  # [size, 384]: columns 192..383
                layer = RowParallelLinear(384, size, ps, method=method)
        if kind == "merged":
            shards = {0: torch.randn(384, size, generator=g) * 0.05, 1: torch.randn(384, size, generator=g) * 0.05}
            own = {0: slice(192, 384), 1: slice(192, 384)}
        elif kind == "qkv":
            shards = {p: torch.randn(256 if p == "q" else 128, size, generator=g) * 0.05 for p in "qkv"}
            own = {"q": slice(128, 256), "k": slice(64, 128), "v": slice(64, 128)}
        else:
            shards = {None: torch.randn(size, 384, generator=g) * 0.05}
        params = dict(layer.named_parameters())
        refs = []
        for shard, w in shards.items():
            stored, ref = tensors(w)
            for suffix, t in stored.items():
                param = params[suffix]
                param.weight_loader(param, t, shard)  # type: ignore[attr-defined]
            refs.append(ref[:, 192:384] if kind == "row" else ref[own[shard]])
        with torch.device(device):
            method.process_weights_after_loading(layer)
        assert layer.method is PACKED_QUANT, f"{name} {kind}: not packed"
        w8a8 = bool(getattr(layer.quant_packed, "w8a8", False))  # where the GPU multiplies FP8 (sm89+)
        x = torch.randn(6, 192 if kind == "row" else size, generator=g).to(dtype)
        y = layer.matmul(x.to(device))
        _close(y, x.double() @ torch.cat(refs).t(), 0.1 if w8a8 else _tolerance(dtype), f"{name} {kind} layer")
        checks += 1
    return checks


def _fp8_rows(w: torch.Tensor, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 values, per-row block scales of the columns' blocks, float64 dequantization) of ``w[rows, cols]``."""
    q, scale = fp8_block_quantize(w)
    ref = q.double() * _expand_blocks(scale.double(), *w.shape)
    r = torch.arange(w.shape[0])[rows]
    c0, c1 = cols.indices(w.shape[1])[:2]
    groups = qg.num_groups(c1 - c0, c0 % qg.GROUP)
    blocks = scale.float()[r // qg.GROUP][:, c0 // qg.GROUP : c0 // qg.GROUP + groups]
    return q[rows, cols], blocks, ref[rows, cols]


def check_fp8_moe(device: str, dtype: torch.dtype, w8a8: bool) -> int:
    """FP8 experts of rank 1 at TP 2 (moe_intermediate 384: rows 192..383 of gate and up, inputs 192..383
    of down, k_offset 64; hidden 192, not a multiple of 128) equal the float64 dequantized experts through
    the torch path, also with an expert held by another rank (id E: skipped)."""
    g = torch.Generator().manual_seed(2)
    e, h, inter, t, k = 4, 192, 384, 7, 2
    own = slice(192, 384)
    w13, s13, r13, w2, s2, r2 = [], [], [], [], [], []
    for _ in range(e):
        gate, up = (torch.randn(inter, h, generator=g) * h**-0.5 for _ in range(2))
        down = torch.randn(h, inter, generator=g) * inter**-0.5
        (gq, gs, gr), (uq, us, ur) = _fp8_rows(gate, own, slice(None)), _fp8_rows(up, own, slice(None))
        dq, ds, dr = _fp8_rows(down, slice(None), own)
        w13.append(torch.cat([gq, uq])), s13.append(torch.cat([gs, us])), r13.append(torch.cat([gr, ur]))
        w2.append(dq), s2.append(ds), r2.append(dr)
    fp8 = Fp8Experts(torch.stack(w13).to(device), torch.stack(s13).to(device), torch.stack(w2).contiguous().to(device),
                     torch.stack(s2).to(device), 192 % qg.GROUP, w8a8)
    x = torch.randn(t, h, generator=g).to(dtype)
    weights, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, dim=-1)
    ids[0, 1] = e  # an expert of another rank
    want = fused_moe_reference(x.double(), torch.stack(r13), torch.stack(r2), weights.double(), ids)
    got = fused_moe_fp8(x.to(device), fp8, weights.to(dtype).to(device), ids.to(device))
    tol = 0.08 if w8a8 else _tolerance(dtype) * 2  # w8a8: activations in e4m3 twice (x and the intermediate)
    _close(got, want, tol, f"fp8 fused MoE {'w8a8' if w8a8 else 'w8a16'} {dtype}")
    return 1


# Triton 3.9's interpreter computes wrongly with bf16 values made inside a kernel (a decoded weight tile in
# tl.dot gives values of 1e8; the fused MoE's bf16 output times the routing weight gives NaN), while bf16
# loaded from memory is fine: on CPU the kernels that make bf16 values run in fp32 and fp16 only.
INTERPRETER_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_kernels(device: str, w8a8: bool = True) -> int:
    """Every kernel on every case; returns the number of checks."""
    g = torch.Generator().manual_seed(0)
    checks = check_quantize(device, g)
    dequantizing = INTERPRETER_DTYPES if device == "cpu" else GPU_DTYPES
    for dtype in GPU_DTYPES:
        if dtype in dequantizing:
            checks += check_fp8(device, dtype, g, w8a8=False)
            checks += check_awq(device, dtype, g)
            checks += check_fp8_moe(device, dtype, w8a8=False)
        if w8a8:
            checks += check_fp8(device, dtype, g, w8a8=True)
            if dtype in dequantizing:  # (the MoE's down kernel multiplies bf16 values it made by the routing weight)
                checks += check_fp8_moe(device, dtype, w8a8=True)
    for dtype in INTERPRETER_DTYPES if device == "cpu" else GPU_DTYPES:
        checks += check_layers(device, dtype)
    return checks


def check_models(device: str) -> int:
    """A one-layer FP8 Qwen3-MoE (hidden 192), a one-layer AWQ Qwen3 and AWQ Qwen3-MoE (whose experts have no
    packed kernel: dequantized) with their projections and experts kept packed give the logits of the CPU path
    (the same checkpoints dequantized at load). On CUDA they are packed as a
    deployment packs them (eager, and CUDA graphs); on CPU (TRITON_INTERPRET=1) packing is forced."""
    import tempfile
    from contextlib import nullcontext
    from pathlib import Path
    from unittest import mock

    from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, make_tiny_qwen3
    from rtp.testing_quant import write_awq_checkpoint, write_fp8_checkpoint
    from tests.kernels.paged_attention_cases import runner_logits

    cpu, dev = torch.device("cpu"), torch.device(device)
    w8a8 = qg.fp8_w8a8_supported(dev)
    # (attention backend, eager, FP8 products): W8A16 packed kernels must give the dequantized model's logits;
    # w8a8 (sm89+) is checked below against the rounding its FP8 activations cause.
    runs = [("torch", True, False)] if dev.type == "cpu" else [("triton", True, False), ("triton", False, False)]
    if w8a8:
        runs.append(("triton", True, True))
    checks = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        moe = make_tiny_qwen3(root / "moe", TinyQwen3MoeSpec(hidden_size=192, moe_intermediate_size=160,
                                                             num_hidden_layers=1))
        dense = make_tiny_qwen3(root / "dense", TinyQwen3Spec(hidden_size=128, intermediate_size=256, head_dim=64,
                                                              num_attention_heads=2, num_key_value_heads=1,
                                                              num_hidden_layers=1))
        awq_moe = make_tiny_qwen3(root / "awq-moe-src", TinyQwen3MoeSpec(
            hidden_size=128, moe_intermediate_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=1))
        models = [(Fp8BlockFormat, write_fp8_checkpoint(moe, root / "fp8")),
                  (AwqFormat, write_awq_checkpoint(dense, root / "awq", root / "awq-ref")),
                  (AwqFormat, write_awq_checkpoint(awq_moe, root / "awq-moe", root / "awq-moe-ref"))]
        for fmt, model_dir in models:
            ref = runner_logits(model_dir, "torch", True, cpu, "float32")
            gemm = mock.Mock(wraps=qg.fp8_block_linear if fmt is Fp8BlockFormat else qg.awq_linear)
            experts = mock.Mock(wraps=fused_moe_fp8)
            for backend, eager, fp8_products in runs:
                if fp8_products and fmt is not Fp8BlockFormat:
                    continue
                force = mock.patch.object(fmt, "packs_on", return_value=True) if dev.type == "cpu" else nullcontext()
                with (force,
                      mock.patch.object(qg, gemm._mock_wraps.__name__, gemm),
                      mock.patch.object(qg, "fp8_w8a8_supported", return_value=fp8_products),
                      mock.patch("rtp.model.moe.fused_moe_fp8", experts)):
                    got = runner_logits(model_dir, backend, eager, dev, "float32").cpu()
                assert gemm.call_count > 0 and (experts.call_count > 0) == (fmt is Fp8BlockFormat), "kernels unused"
                if fp8_products:
                    _check_w8a8_model(got, ref, runner_logits(model_dir, "torch", True, cpu, "float32",
                                                              prepare=_round_activations_to_fp8))
                else:
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    tol = 1e-4 if dev.type == "cpu" else 1e-3
                    assert err < tol, f"tiny {fmt.name} model on {device} (eager={eager}), packed vs dequantized " \
                                      f"on CPU: max error {err:.2e}"
                checks += 1
    return checks


def _round_activations_to_fp8(runner: Any) -> None:  # noqa: ANN401
    """Hooks that round the inputs of the projections and experts as w8a8 does (e4m3, a scale per token and
    128-column group): the dequantized CPU model then shows how far FP8 activations alone move the logits."""

    def rounded(_module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        q, scale = qg.quantize_fp8_groups_reference(x.reshape(-1, x.shape[-1]).float())
        scale = scale.repeat_interleave(qg.GROUP, dim=1)[:, : x.shape[-1]]
        return ((q.float() * scale).view(x.shape).to(x.dtype), *args[1:])

    for name, module in runner.model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts")):
            module.register_forward_pre_hook(rounded)


def _check_w8a8_model(got: torch.Tensor, ref: torch.Tensor, rounded: torch.Tensor) -> None:
    """w8a8's logits may differ from the dequantized model's by what rounding its activations to e4m3 causes
    (on a random tiny MoE a few % of every logit, and a token routed to another expert moves its row by tens
    of %): the relative (Frobenius) error must stay within 1.5x of that of the CPU model with its projection
    and expert inputs rounded the same way (the w8a8 MoE also rounds the experts' intermediate), plus 0.02."""
    err, bound = ((got - ref).norm() / ref.norm()).item(), ((rounded - ref).norm() / ref.norm()).item()
    assert err <= 1.5 * bound + 0.02, f"tiny fp8 model, w8a8: relative error {err:.3f}, activations rounded " \
                                      f"to e4m3 on CPU: {bound:.3f}"
    print(f"tiny fp8 model, w8a8: relative error {err:.3f} (activations rounded to e4m3 on CPU: {bound:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    w8a8 = args.device == "cpu" or qg.fp8_w8a8_supported(torch.device(args.device))
    n = check_kernels(args.device, w8a8=w8a8)
    n += check_models(args.device)
    print(f"OK {n} quantized-GEMM checks on {args.device}" + ("" if w8a8 else " (no w8a8: GPU below sm89)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
