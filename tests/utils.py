"""Helpers shared by the tests: launching torchrun, model shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rtp.testing import TinyQwen3Spec

REPO = Path(__file__).resolve().parent.parent

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
