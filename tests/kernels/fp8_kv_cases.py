"""The FP8 KV cache's Triton kernels (store, paged attention) against torch and float64 references.

    TRITON_INTERPRET=1 python -m tests.kernels.fp8_kv_cases   # CPU, the interpreter (fp32 queries)
    python -m tests.kernels.fp8_kv_cases --device cuda        # a GPU (fp32 and bf16 queries, the model)

tests/kernels/test_fp8_kv.py runs the first, scripts/gpu_check.sh the second. Prints one line per check
and "OK" at the end; exits 1 at the first mismatch.

The store kernel rounds to e4m3's grid in fp32 before its cast (see ``_round_to_e4m3``), so it matches the
torch reference bit for bit under the interpreter as on a GPU, ties, subnormals and binade tops included.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

from rtp.kernels.fp8_kv import FP8_KV_DTYPE, FP8_MAX
from rtp.kernels.kv_store import store_kv_reference, store_kv_triton
from rtp.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)


def e4m3_edges() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), one fp32 step either side of each
    midpoint, and values past +-448 (saturation): the inputs where a rounding mistake shows."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV_DTYPE).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid.nextafter(torch.full_like(mid, -1e9)), mid.nextafter(torch.full_like(mid, 1e9))])
    return torch.cat([grid, mid, near, torch.tensor([449.0, -460.0, 1e6, -1e6])])


def check_store(device: torch.device, gen: torch.Generator) -> str:
    """Triton's FP8 store writes what the reference writes, byte for byte: the e4m3 edge values, random
    bf16 and fp32 keys and values (some past 448 * scale), skipped slots."""
    edges = e4m3_edges()
    n = edges.numel()
    key = edges.view(n, 1, 1).to(device)
    slots = torch.arange(n, device=device)
    one = torch.ones(1, device=device)
    caches = [torch.zeros(n, 1, 1, 1, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
    store_kv_reference(key, key, caches[0], caches[1], slots, one, one)
    store_kv_triton(key, key, caches[2], caches[3], slots, one, one)
    if not torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8)):
        bad = (caches[0].float() != caches[2].float()).flatten().nonzero().flatten()[:5].cpu()
        raise AssertionError(f"store: e4m3 edge values {edges[bad].tolist()} differ from the reference")
    for dtype in (torch.float32, torch.bfloat16):
        t, heads, dim = 41, 2, 24
        key = (torch.randn(t, heads, dim, generator=gen) * 4).to(device, dtype)
        value = (torch.randn(t, heads, dim, generator=gen) * 300).to(device, dtype)  # some past 448 * v_scale
        slots = torch.randperm(6 * 8, generator=gen)[:t].to(device)
        slots[::6] = -1
        k_scale = torch.tensor([0.03], device=device)
        v_scale = torch.tensor([0.5], device=device)
        caches = [torch.zeros(6, 8, heads, dim, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
        store_kv_reference(key, value, caches[0], caches[1], slots, k_scale, v_scale)
        store_kv_triton(key, value, caches[2], caches[3], slots, k_scale, v_scale)
        for name, want, got in (("k", caches[0], caches[2]), ("v", caches[1], caches[3])):
            if not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                differ = int((want.view(torch.uint8) != got.view(torch.uint8)).sum())
                raise AssertionError(f"store {name} {str(dtype).removeprefix('torch.')}: {differ} bytes differ "
                                     "from the reference")
        if caches[3].float().abs().max() != FP8_MAX:
            raise AssertionError("store: values past 448 * v_scale must saturate at 448")
    return f"store: triton == reference byte for byte ({n} e4m3 edge values, random fp32 and bf16 rows)"


def attention_f64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: torch.Tensor, tables: torch.Tensor, q_lens: list[int], k_lens: list[int],
                  scale: float) -> torch.Tensor:
    """Causal attention in float64 over the dequantized cache, written out (no kernel, no SDPA)."""
    bs, rep = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    k_all = (k_cache.double() * k_scale.double()).flatten(0, 1).cpu()  # [slots, Hkv, D]
    v_all = (v_cache.double() * v_scale.double()).flatten(0, 1).cpu()
    out, start = [], 0
    for i, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        pos = torch.arange(kl)
        slots = tables[i].cpu().long()[pos // bs] * bs + pos % bs
        k = k_all[slots].repeat_interleave(rep, dim=1)  # [kl, Hq, D]
        v = v_all[slots].repeat_interleave(rep, dim=1)
        qi = q[start : start + ql].double().cpu()
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        s = s.masked_fill(pos[None, None, :] > torch.arange(kl - ql, kl)[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += ql
    return torch.cat(out)


def fp8_case(q_lens: list[int], k_lens: list[int], hq: int, hkv: int, d: int, bs: int, device: torch.device,
             dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Random queries, an FP8 cache written through the reference store, shuffled tables, poisoned free slots."""
    need = [-(-k // bs) for k in k_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n] + [0] * (max(need) - n))
        perm = perm[n:]
    k_scale, v_scale = torch.tensor([0.04], device=device), torch.tensor([0.25], device=device)
    shape = (num_blocks, bs, hkv, d)
    k_cache = torch.full(shape, FP8_MAX, dtype=FP8_KV_DTYPE, device=device)  # a stray read would be far off
    v_cache = torch.full(shape, -FP8_MAX, dtype=FP8_KV_DTYPE, device=device)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, k in zip(tables, k_lens) for p in range(k)], device=device)
    keys = (torch.randn(len(slots), hkv, d, generator=gen) * 3).to(device)
    values = torch.randn(len(slots), hkv, d, generator=gen).to(device)
    store_kv_reference(keys, values, k_cache, v_cache, slots, k_scale, v_scale)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {"q": torch.randn(sum(q_lens), hq, d, generator=gen).to(device, dtype), "k_cache": k_cache,
            "v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale, "cu_q": cu_q,
            "tables": torch.tensor(tables, dtype=torch.int32, device=device),
            "ctx": torch.tensor(k_lens, dtype=torch.int32, device=device)}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> float:
    err = (got.double().cpu() - want).abs().max().item()
    if not err <= atol:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {atol}")
    return err


CASES = [
    # (name, q_lens, k_lens, Hq, Hkv, head_dim, block_size)
    ("decode-gqa", [1, 1, 1, 1], [1, 8, 9, 37], 4, 2, 16, 8),
    ("mixed-gqa", [1, 6, 3, 1], [12, 6, 19, 5], 4, 1, 32, 4),
]


def check_attention(device: torch.device, dtype: torch.dtype, atol: float, gen: torch.Generator) -> str:
    """Both Triton kernels (and the torch references) on an FP8 cache against float64 on its dequantized values."""
    worst = 0.0
    for name, q_lens, k_lens, hq, hkv, d, bs in CASES:
        t = fp8_case(q_lens, k_lens, hq, hkv, d, bs, device, dtype, gen)
        scales = {"k_scale": t["k_scale"], "v_scale": t["v_scale"]}
        scale = d**-0.5
        want = attention_f64(t["q"], t["k_cache"], t["v_cache"], t["k_scale"], t["v_scale"], t["tables"],
                             q_lens, k_lens, scale)
        got = paged_prefill_attention(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["cu_q"], t["ctx"], scale,
                                      block_m=16, block_n=16, **scales)
        worst = max(worst, _close(f"{name} prefill kernel", got, want, atol))
        ref = paged_prefill_attention_reference(t["q"], t["k_cache"], t["v_cache"], q_lens, k_lens, scale,
                                                t["tables"], None, t["k_scale"], t["v_scale"])
        worst = max(worst, _close(f"{name} prefill reference", ref, want, atol))
        if all(q == 1 for q in q_lens):
            for splits in (1, 4):
                got = paged_decode_attention(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"], scale,
                                             num_splits=splits, block_n=16, **scales)
                worst = max(worst, _close(f"{name} decode kernel, splits={splits}", got, want, atol))
            ref = paged_decode_attention_reference(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"],
                                                   max(k_lens), scale, t["k_scale"], t["v_scale"])
            worst = max(worst, _close(f"{name} decode reference", ref, want, atol))
    return f"attention {str(dtype).removeprefix('torch.')}: kernels and references vs float64, max error {worst:.2e}"


def runner_logits(model_dir: Path, backend: str, kv_cache_dtype: str, device: torch.device, dtype: str) -> torch.Tensor:
    """Logits ``[steps, 2, vocab]`` of a ModelRunner pinned to ``backend``: two prompts, then decode steps fed
    fixed tokens (every run sees the same inputs)."""
    from rtp.config import CacheConfig, ModelConfig, RtpConfig
    from rtp.core.step import CachedSeq, NewSeq, StepPlan
    from rtp.distributed.parallel import ParallelState
    from rtp.runtime.model_runner import ModelRunner

    with mock.patch("rtp.runtime.model_runner.choose_attn_backend", return_value=backend):
        config = RtpConfig(model=ModelConfig(dtype=dtype, enforce_eager=True),
                           cache=CacheConfig(num_kv_blocks=16, block_size=16, kv_cache_dtype=kv_cache_dtype))
        runner = ModelRunner(ParallelState.single(device.type), model_dir, config)
    try:
        prompts, blocks = [list(range(1, 36)), list(range(40, 60))], [[0, 1, 2], [5, 4, 3]]
        logits = [runner.execute(StepPlan(new_seqs=[NewSeq(i, p, blocks[i], 0, len(p))
                                                    for i, p in enumerate(prompts)])).sample_logits]
        for step in range(5):
            toks = [(7 * step + 3 * i) % 500 for i in range(2)]
            logits.append(runner.execute(StepPlan(cached_seqs=[CachedSeq(i, 1, [toks[i]], []) for i in range(2)]))
                          .sample_logits)
        return torch.stack(logits).float().cpu()
    finally:
        runner.close()


def check_runner(device: torch.device, tmp: Path) -> str:
    """The whole model with an FP8 cache: the triton backend against the torch backend (both FP8).

    On a GPU both run in bf16, whose logits differ by their rounding (other summation orders, fp32 vs bf16
    intermediates): each is measured against the float32 model (torch backend, CPU, FP8 cache too), and
    Triton must be no further from it than the torch backend is."""
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    model_dir = make_tiny_qwen3(tmp / "m", TinyQwen3Spec(num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    if device.type != "cuda":
        torch_logits = runner_logits(model_dir, "torch", "fp8_e4m3", device, "float32")
        triton_logits = runner_logits(model_dir, "triton", "fp8_e4m3", device, "float32")
        err = (triton_logits - torch_logits).abs().max().item()
        if not err <= 1e-3:
            raise AssertionError(f"model with an fp8 cache: triton vs torch backend, max logit difference {err:.3g}")
        return f"model, fp8 cache: triton backend vs torch backend, max logit difference {err:.2e}"
    ref = runner_logits(model_dir, "torch", "fp8_e4m3", torch.device("cpu"), "float32")
    err_torch = (runner_logits(model_dir, "torch", "fp8_e4m3", device, "bfloat16") - ref).abs().max().item()
    err_triton = (runner_logits(model_dir, "triton", "fp8_e4m3", device, "bfloat16") - ref).abs().max().item()
    if not err_triton <= 1.5 * err_torch + 2e-2:
        raise AssertionError(f"model with an fp8 cache, bf16: triton {err_triton:.3g} from the fp32 model, "
                             f"torch backend {err_torch:.3g}")
    return (f"model, fp8 cache, bf16: max logit difference from the fp32 model {err_triton:.3g} (triton), "
            f"{err_torch:.3g} (torch backend)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (needs TRITON_INTERPRET=1) or cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    runs = [(torch.float32, 1e-4)] + ([(torch.bfloat16, 2e-2)] if device.type == "cuda" else [])
    try:
        print(check_store(device, gen))
        for dtype, atol in runs:
            print(check_attention(device, dtype, atol, gen))
        with tempfile.TemporaryDirectory() as tmp:
            print(check_runner(device, Path(tmp)))
    except AssertionError as e:
        print(f"FAIL {e}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
