"""Every case of the dry run (dense and MoE, TP 1 and 2, each attention backend), merged into one table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rtp.fake_cuda.dry_run import Case, StageResult, run_rank
from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, add_kv_scales, make_tiny_qwen3
from rtp.testing_quant import write_awq_checkpoint, write_fp8_checkpoint

BACKENDS = ("triton", "torch")  # every choice that does not need flash-attn installed


def default_cases() -> list[Case]:
    """Dense and MoE x TP 1 and 2 x each backend, expert-parallel MoE at TP 2, quantized checkpoints at TP 2
    (FP8 on sm90 GPUs, FP8 products, also expert-parallel, and on sm80 ones, the W8A16 kernels), the FP8 KV
    cache (a checkpoint with k/v scales) at TP 2 on each backend."""
    cases = [Case(model, tp, backend) for model in ("dense", "moe") for tp in (1, 2) for backend in BACKENDS]
    return cases + [Case("moe", 2, "triton", expert_parallel=True), Case("moe-fp8", 2, "triton"),
                    Case("moe-fp8", 2, "triton", expert_parallel=True), Case("moe-fp8", 2, "triton", capability=(8, 0)),
                    Case("dense-awq", 2, "triton"),
                    *(Case("dense-kv-scales", 2, backend, kv_cache_dtype="fp8_e4m3") for backend in BACKENDS)]


def make_models(root: Path) -> dict[str, Path]:
    """The tiny random bf16 checkpoints of the dry run, written under ``root``.

    Shapes only matter in a trace, so the models are as small as covers every path: dense Qwen3 with one
    layer; Qwen3-MoE with a dense layer (``mlp_only_layers``) then a sparse one; that MoE in Qwen's FP8
    block format, a dense Qwen3 of AWQ-sized projections (inputs a multiple of 128) in AWQ, and the dense
    Qwen3 with per-layer FP8 KV-cache scales.
    """
    moe = make_tiny_qwen3(root / "moe", TinyQwen3MoeSpec(mlp_only_layers=(0,)), torch.bfloat16)
    awq_src = make_tiny_qwen3(root / "awq-src", TinyQwen3Spec(hidden_size=128, num_attention_heads=2,
                                                             num_key_value_heads=1, head_dim=64,
                                                             num_hidden_layers=1), torch.bfloat16)
    return {
        "dense": make_tiny_qwen3(root / "dense", TinyQwen3Spec(num_hidden_layers=1), torch.bfloat16),
        "moe": moe,
        "moe-fp8": write_fp8_checkpoint(moe, root / "moe-fp8"),
        "dense-awq": write_awq_checkpoint(awq_src, root / "dense-awq", root / "awq-ref"),
        "dense-kv-scales": add_kv_scales(make_tiny_qwen3(root / "dense-kv-scales", TinyQwen3Spec(num_hidden_layers=1),
                                                         torch.bfloat16), [0.05], [0.02]),
    }


@dataclass
class Row:
    """One (model, TP, backend, stage) of the table, over every rank of the case."""

    case: Case
    stage: str
    status: str
    note: str
    errors: list[str] = field(default_factory=list)  # "rank r: <stack>" of each failed rank


def merge_ranks(case: Case, per_rank: list[list[StageResult]]) -> list[Row]:
    """One row per stage: FAIL if a rank failed, else PASS if a rank ran it, else SKIP."""
    rows = []
    for stage in dict.fromkeys(r.stage for results in per_rank for r in results):
        results = [(rank, r) for rank, rs in enumerate(per_rank) for r in rs if r.stage == stage]
        failed = [(rank, r) for rank, r in results if r.status == "FAIL"]
        if failed:
            status = "FAIL"
            note = "; ".join(f"rank {rank}: {r.note}" for rank, r in failed)
        else:
            status = "PASS" if any(r.status == "PASS" for _, r in results) else "SKIP"
            note = results[0][1].note
        rows.append(Row(case, stage, status, note, [f"rank {rank}: {r.error}" for rank, r in failed]))
    return rows


def run_case(case: Case, model_dir: Path) -> list[Row]:
    """Trace every rank of ``case`` in turn (one process: the fake process group needs no peers)."""
    return merge_ranks(case, [run_rank(case, rank, model_dir) for rank in range(case.tp)])


def format_table(rows: list[Row]) -> str:
    """A markdown table: model, TP, backend, stage, result, note."""
    lines = ["| model | TP | backend | stage | result | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(f"| {r.case.model_label} | {r.case.tp} | {r.case.backend} | {r.stage} | {r.status} | {note} |")
    return "\n".join(lines)
