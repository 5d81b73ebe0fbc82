"""The fake-CUDA dry run passes on the real code and fails, with a clear message, on planted GPU bugs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rtp.fake_cuda.dry_run import STAGES, Case, StageResult, run_rank
from rtp.fake_cuda.report import default_cases, make_models, run_case
from rtp.model import attention, ops


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("fake-cuda-models"))


def _by_stage(results: list[StageResult]) -> dict[str, StageResult]:
    return {r.stage: r for r in results}


def test_every_case_and_stage_passes(models):
    rows = [row for case in default_cases() for row in run_case(case, models[case.model])]
    failed = [f"{r.case} / {r.stage}: {r.note}\n{r.errors}" for r in rows if r.status == "FAIL"]
    assert not failed, "\n".join(failed)
    seen = {(r.case.model, r.case.tp, r.case.backend) for r in rows}
    assert seen == {(m, tp, b) for m in ("dense", "moe") for tp in (1, 2) for b in ("triton", "torch")} | {
        ("moe-fp8", 2, "triton"), ("dense-awq", 2, "triton"), ("dense-kv-scales", 2, "triton"),
        ("dense-kv-scales", 2, "torch")}
    fp8_start = [r for r in rows if r.case.kv_cache_dtype == "fp8_e4m3" and r.stage == STAGES[0]]
    assert len(fp8_start) == 2 and all("(float8_e4m3fn)" in r.note for r in fp8_start), fp8_start
    for r in rows:
        # Graph stages run where graphs exist (triton); the torch backend decodes eagerly.
        if r.stage == "CUDA-graph capture":
            assert r.status == ("PASS" if r.case.backend == "triton" else "SKIP"), r
        elif r.stage != "sampler":
            assert r.status == "PASS", r
    assert {r.stage for r in rows} == set(STAGES)
    # Quantized checkpoints run packed: FP8 products on the sm90 GPUs, the W8A16 kernels on sm80 ones, AWQ int4.
    packed = {r.case.model_label: {part.split(" x ", 1)[1] for part in r.note.split("; ") if " x " in part}
              for r in rows if r.stage == STAGES[0] and r.case.model in ("moe-fp8", "dense-awq")}
    assert packed == {"moe-fp8": {"Fp8Experts (w8a8)", "Fp8Packed (w8a8)"},
                      "moe-fp8 (EP)": {"Fp8Experts (w8a8)", "Fp8Packed (w8a8)"},
                      "moe-fp8 (sm80)": {"Fp8Experts", "Fp8Packed"}, "dense-awq": {"AwqPacked"}}, packed
    decode = [r for r in rows if r.case == Case("dense", 1, "triton") and r.stage.startswith("decode")]
    assert [r.note.split(";")[0] for r in decode] == [
        "graph 1 replayed", "graph 4 replayed, 1 padding rows", "eager (above the largest graph, 4)",
    ]


def test_planted_cpu_index_in_decode_is_caught(models, monkeypatch):
    real = attention.paged_decode_attention

    def cpu_index(q, *args, **kwargs):  # noqa: ANN001, ANN202
        rows = torch.arange(q.shape[0])  # a CPU index into a CUDA tensor
        return real(q[rows], *args, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", cpu_index)
    start = _by_stage(run_rank(Case("dense", 1, "triton"), 0, models["dense"]))[STAGES[0]]
    assert start.status == "FAIL"
    # Caught while the largest decode graph (batch 4) is captured.
    assert "DeviceMismatchError" in start.note and "CPU tensor int64[4]" in start.note, start.note
    assert "in a CUDA-graph capture" in start.note
    assert "cpu_index" in start.error  # the stack names the planted line


def test_planted_fp32_buffer_meeting_bf16_activations_is_caught(models, monkeypatch):
    def rotate_without_cast(x, cos, sin):  # noqa: ANN001, ANN202
        x1, x2 = x.chunk(2, dim=-1)  # bf16 times the fp32 cos/sin buffers: the result is fp32
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    monkeypatch.setattr(ops, "_rotate", rotate_without_cast)
    results = _by_stage(run_rank(Case("dense", 1, "triton"), 0, models["dense"]))
    start = results[STAGES[0]]
    assert start.status == "FAIL"
    # Caught in the profiling pass already: fp32 q/k meet the bf16 v in attention.
    assert "same dtype" in start.note and "BFloat16" in start.note, start.note
    assert all(r.status == "SKIP" for name, r in results.items() if name != STAGES[0])


def test_planted_item_in_captured_step_is_caught(models, monkeypatch):
    real = attention.PagedAttention._triton

    def with_item(self, q, meta, tables):  # noqa: ANN001, ANN202
        if int(meta.context_lens.max().item()) > 0:  # a host sync in the captured decode
            pass
        return real(self, q, meta, tables)

    monkeypatch.setattr(attention.PagedAttention, "_triton", with_item)
    start = _by_stage(run_rank(Case("dense", 1, "triton"), 0, models["dense"]))[STAGES[0]]
    assert start.status == "FAIL"
    assert "HostSyncError" in start.note and "inside a CUDA-graph capture" in start.note, start.note
    assert "with_item" in start.error
