"""The C++ CPU decode and varlen kernels equal the torch references, and the runtime uses them on CPU."""

from __future__ import annotations

import pytest
import torch

from rtp.kernels import cpu_attention, cpu_build
from rtp.kernels.paged_attention import paged_decode_attention_reference, paged_prefill_attention_reference
from tests.kernels.paged_attention_cases import CPU_CASES, Case, build
from tests.utils import HAS_CXX

pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: the kernels cannot be built")


def test_kernel_builds() -> None:
    """A compiler is here, so the kernel must build (a failed build would leave only the torch path)."""
    assert cpu_attention.load() is not None


CASES = [c for c in CPU_CASES if c.decode] + [
    # GQA 4:1, a long context over many blocks, one sequence of a single token
    Case("decode-gqa4-long", [1] * 3, [1, 700, 129], 8, 2, 64, 16),
    # block size 1 and head_dim 128 (Qwen3's)
    Case("decode-bs1-d128", [1] * 2, [3, 50], 4, 4, 128, 1),
    # MQA: every query head reads the one KV head
    Case("decode-mqa", [1] * 5, [2, 15, 16, 17, 64], 6, 1, 32, 16),
    # many sequences (at least 4 per thread up to 16 threads): one task per sequence over all its KV heads,
    # head_dim 40 (a 16-wide loop, then a tail of 8)
    Case("decode-many-seqs", [1] * 64, [1 + (7 * i) % 90 for i in range(64)], 6, 3, 40, 8),
    # GQA 2:1 (two query rows share each key and value load on AVX-512) with head_dim 20 (scalar tails),
    # few and many sequences
    Case("decode-gqa-d20", [1] * 3, [5, 17, 40], 4, 2, 20, 4),
    Case("decode-gqa-d20-many", [1] * 40, [1 + (5 * i) % 37 for i in range(40)], 4, 2, 20, 4),
    # Qwen3-0.6B's heads (16 / 8 of 128) over blocks of 16, many sequences of up to 9 blocks: the paths that
    # prefetch the next block key by key, the first block of values after the last keys, the next task's keys
    Case("decode-many-d128", [1] * 64, [1 + (11 * i) % 140 for i in range(64)], 16, 8, 128, 16),
    # one long sequence: its keys in ranges cut mid-block (multiples of 8 keys), merged at the end
    Case("decode-one-long-d128", [1], [1000], 16, 8, 128, 16),
    # head_dim 96: bf16 values in groups of 64 outputs, then one of 32 (pv_pairs_dec with AVX-512 BF16, else
    # pv_split), few and many sequences
    Case("decode-gqa-d96", [1] * 3, [9, 40, 300], 8, 4, 96, 16),
    Case("decode-gqa-d96-many", [1] * 24, [1 + (13 * i) % 70 for i in range(24)], 8, 4, 96, 16),
]


PREFILL_CASES = [c for c in CPU_CASES if not c.decode] + [
    # Qwen3's head_dim, GQA 2:1, a long prompt over several 16-query chunks after a cached prefix,
    # beside decode rows and a whole prompt
    Case("mixed-d128-long", [1, 70, 33, 1], [300, 100, 33, 17], 16, 8, 128, 16),
    # block size 1, MQA, one query chunk ending exactly on 16 queries
    Case("prefill-mqa-bs1", [16, 17], [20, 17], 6, 1, 32, 1),
    # blocks of 128 (several 64-key chunks in one block), GQA 4:1, head_dim 72 (whole tiles, then a tail
    # of 8), 150 queries after a prefix of 60 (query chunks of 32 ending mid-tile), a 40-token prompt
    Case("prefill-bs128-d72", [150, 40], [210, 40], 8, 2, 72, 128),
    # a 64-key chunk over two blocks of 32, head_dim 80 (with AVX-512 two 32-wide tiles, then one register),
    # 257 queries past a prefix of 43
    Case("prefill-d80-bs32", [257, 33], [300, 33], 8, 4, 80, 32),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_varlen_kernel_matches_reference(case: Case, dtype: torch.dtype, atol: float) -> None:
    t = build(case, torch.device("cpu"), dtype, torch.Generator().manual_seed(len(case.name)))
    scale = case.head_dim**-0.5
    ref = paged_prefill_attention_reference(t["q"].float(), t["k_cache"].float(), t["v_cache"].float(),
                                            case.q_lens, case.k_lens, scale, t["tables"])
    got = cpu_attention.paged_prefill_attention_cpu(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["cu_q"],
                                                    t["ctx"], scale)
    assert got.dtype == dtype and got.shape == t["q"].shape
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=atol)  # poisoned unowned slots would show


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference(case: Case, dtype: torch.dtype, atol: float) -> None:
    t = build(case, torch.device("cpu"), dtype, torch.Generator().manual_seed(len(case.name)))
    scale = case.head_dim**-0.5
    ref = paged_decode_attention_reference(t["q"].float(), t["k_cache"].float(), t["v_cache"].float(),
                                           t["tables"], t["ctx"], max(case.k_lens), scale)
    got = cpu_attention.paged_decode_attention_cpu(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"], scale)
    assert got.dtype == dtype and got.shape == t["q"].shape
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=atol)  # poisoned unowned slots would show


SHARED_CASES = [
    # (case, leading blocks every sequence shares; the cascade pass takes 8 sequences sharing 256 keys):
    # Qwen3-0.6B's heads, 8 sequences over 256 shared keys, one of them a single key past them
    (Case("shared-d128", [1] * 8, [257, 270, 290, 328, 329, 350, 400, 256 + 77], 16, 8, 128, 16), 16),
    # GQA 4:1, head_dim 96, 288 shared keys (four KB chunks, then a partial one)
    (Case("shared-gqa4-d96", [1] * 8, [289, 300, 310, 330, 400, 290, 500, 301], 8, 2, 96, 16), 18),
    # MQA, head_dim 32: one KV head, so the shared keys go in several chunks (parts merged per row)
    (Case("shared-mqa-d32", [1] * 8, [273, 280, 290, 350, 400, 274, 300, 333], 4, 1, 32, 16), 17),
    # MHA, head_dim 64: 9 rows a KV head (tiles of 8, then 2 with a padding row)
    (Case("shared-mha-d64", [1] * 9, [257 + 13 * i for i in range(9)], 2, 2, 64, 16), 16),
    # 32 sequences sharing 512 keys (a system prompt), blocks of 16
    (Case("shared-many-d128", [1] * 32, [513 + (29 * i) % 90 for i in range(32)], 16, 8, 128, 16), 32),
    # 7 sequences sharing 512 keys: fewer than the cascade pass takes (each scores them itself)
    (Case("shared-few-d128", [1] * 7, [513 + (29 * i) % 90 for i in range(7)], 16, 8, 128, 16), 32),
]


@pytest.mark.parametrize("case, shared", SHARED_CASES, ids=lambda c: getattr(c, "name", ""))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_over_shared_leading_blocks_matches_reference(case: Case, shared: int, dtype: torch.dtype,
                                                             atol: float) -> None:
    """Sequences whose tables start with the same blocks (a cached prefix): bf16 caches on AVX-512 BF16 score
    those keys for all sequences at once (the cascade pass) and merge them with each sequence's own keys."""
    t = build(case, torch.device("cpu"), dtype, torch.Generator().manual_seed(len(case.name)))
    t["tables"][:, :shared] = t["tables"][0, :shared]
    scale = case.head_dim**-0.5
    ref = paged_decode_attention_reference(t["q"].float(), t["k_cache"].float(), t["v_cache"].float(),
                                           t["tables"], t["ctx"], max(case.k_lens), scale)
    got = cpu_attention.paged_decode_attention_cpu(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"], scale)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=atol)


def test_bf16_decode_without_avx512_bf16_matches_reference() -> None:
    """A CPU without AVX-512 BF16 decodes bf16 caches by widening them to fp32 (with AVX-512: pv_split's pair-split
    values): the decode cases through a build of the same source without those instructions."""
    module = cpu_build.build("cpu_attention_nobf16", cpu_attention._SOURCE, ["paged_decode", "paged_prefill"],
                             extra_cflags=("-ffp-contract=fast", "-mno-avx512bf16"))
    assert module is not None
    for case in CASES:
        t = build(case, torch.device("cpu"), torch.bfloat16, torch.Generator().manual_seed(len(case.name)))
        scale = case.head_dim**-0.5
        ref = paged_decode_attention_reference(t["q"].float(), t["k_cache"].float(), t["v_cache"].float(),
                                               t["tables"], t["ctx"], max(case.k_lens), scale)
        got = module.paged_decode(t["q"], t["k_cache"], t["v_cache"], t["tables"], t["ctx"], scale)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2, msg=case.name)


def test_bad_shapes_are_refused() -> None:
    q = torch.zeros(2, 3, 16)  # 3 query heads do not split over 2 KV heads
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_attention.paged_decode_attention_cpu(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                                 torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_attention.paged_prefill_attention_cpu(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                                  torch.tensor([0, 2], dtype=torch.int32),
                                                  torch.full((1,), 2, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="end at the number of query tokens"):
        cpu_attention.paged_prefill_attention_cpu(torch.zeros(2, 4, 16), cache, cache,
                                                  torch.zeros(1, 1, dtype=torch.int32),
                                                  torch.tensor([0, 3], dtype=torch.int32),
                                                  torch.full((1,), 3, dtype=torch.int32), 1.0)


def test_cpu_backend_layer_matches_torch_backend_on_mixed_steps() -> None:
    # Decode rows beside prompt chunks (some with a cached prefix): the cpu backend's kernels equal torch's path.
    from rtp.model.attention import PagedAttention
    from tests.kernels.paged_attention_cases import step_metadata

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 16, 4
    layers = {}
    for backend in ("cpu", "torch"):
        layer = layers[backend] = PagedAttention(hq, hkv, d, d**-0.5)
        layer.backend = backend
        layer.k_cache, layer.v_cache = torch.zeros(2, 16, bs, hkv, d)
    tables = [[5, 2, 7], [0, 3, 6], [1, 4, 8], [9, 10, 11]]
    steps = [([5, 3, 2, 1], [5, 3, 2, 1]),  # whole prompts, one of a single token
             ([1, 4, 1, 1], [6, 7, 3, 2]),  # three decode rows beside a prefill chunk after a prefix
             ([1, 1, 3, 1], [7, 8, 6, 3]),  # decode rows around a chunk
             ([1, 1, 1, 1], [8, 9, 7, 4])]  # decode only
    for q_lens, k_lens in steps:
        meta = step_metadata(q_lens, k_lens, tables, bs, torch.device("cpu"))
        q = torch.randn(sum(q_lens), hq, d, generator=gen)
        k, v = torch.randn(2, sum(q_lens), hkv, d, generator=gen)
        got, want = (layers[b](q, k, v, meta) for b in ("cpu", "torch"))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(layers["cpu"].k_cache, layers["torch"].k_cache)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch) -> None:
    # torch's loader waits forever on a lock left by a killed build; a live build's lock is young.
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "rtp_test_ext" / "lock"
    lock.parent.mkdir()
    lock.touch()
    cpu_build._remove_stale_build_lock("rtp_test_ext")
    assert lock.exists()
    old = time.time() - 2 * cpu_build._STALE_LOCK_S
    os.utime(lock, (old, old))
    cpu_build._remove_stale_build_lock("rtp_test_ext")
    assert not lock.exists()
