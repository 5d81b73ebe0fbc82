"""Helpers shared by the tests: launching torchrun, model shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"  # the scripts that tests run under torchrun (one process per rank)

# Shapes the numerical tests run on; together they cover the TP corner cases.
SHAPES: dict[str, TinyQwen3Spec] = {
    # 2 KV heads: at TP=4 each KV head is replicated on two ranks.
    "default": TinyQwen3Spec(),
    # vocab not divisible by 2 or 4, untied head, checkpoint in two shards.
    "odd_vocab_untied_sharded": TinyQwen3Spec(
        vocab_size=509, num_key_value_heads=4, tie_word_embeddings=False, num_shards=2, seed=1
    ),
    # one KV head (MQA), wider heads, linear rope scaling, three shards.
    "mqa_rope_scaled": TinyQwen3Spec(
        hidden_size=96, num_attention_heads=8, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
        intermediate_size=192, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=50000.0,
        tie_word_embeddings=False, num_shards=3, seed=2,
    ),
}

# Qwen3-MoE shapes. They share the vocabulary size so one torchrun per TP size runs both.
MOE_SHAPES: dict[str, TinyQwen3MoeSpec] = {
    # 2 KV heads (replicated at TP=4), a dense layer between two sparse ones, top-2 of 8
    # experts with renormalised routing weights, tied embeddings, one file.
    "moe_dense_layer": TinyQwen3MoeSpec(num_hidden_layers=3, mlp_only_layers=(1,)),
    # top-8 of 16 experts without renormalisation, every layer sparse, untied head, three shards.
    "moe_top8_sharded": TinyQwen3MoeSpec(
        num_experts=16, num_experts_per_tok=8, moe_intermediate_size=24, norm_topk_prob=False,
        num_key_value_heads=4, tie_word_embeddings=False, num_shards=3, seed=4,
    ),
}


# rtp's C++ CPU kernels build wherever a compiler is: their tests skip only without one, so a kernel
# whose source fails to compile fails its tests instead of hiding behind the torch fallback.
HAS_CXX = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def with_generation_config(src: Path, dst: Path, **settings: Any) -> Path:  # noqa: ANN401
    """A copy of the checkpoint folder ``src`` at ``dst`` whose generation_config.json also holds ``settings``."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return dst


def with_positions(model_dir: Path, positions: int) -> Path:
    """``model_dir`` (a copy made by the caller) whose config.json says ``max_position_embeddings: positions``: a
    longer context for a test that needs long runs of the tiny model (rtp refuses a max_model_len past it)."""
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": positions}))
    return model_dir


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation, never stopping early at EOS.

    The attention mask is explicit: otherwise generate() treats prompt tokens
    equal to the pad id as padding.
    """
    import torch

    hf_model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --standalone`` (a free rendezvous port per run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    out = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"torchrun failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out


def rank_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the ranks a torchrun agent started (its children with RANK in their environment)."""
    pids = {}
    children = subprocess.run(["ps", "--ppid", str(agent_pid), "-o", "pid="], capture_output=True, text=True)
    for pid in map(int, children.stdout.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = pid
    return pids
