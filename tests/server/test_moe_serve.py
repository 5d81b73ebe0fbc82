"""launch/serve.py at TP=2 on CPU serving a tiny Qwen3-MoE (``--model``), against transformers' greedy output."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.testing import make_tiny_qwen3
from tests.server.test_serve_e2e import kill, launch, wait_ready
from tests.utils import MOE_SHAPES, hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.mark.timeout(600)
def test_server_with_moe_model_returns_hf_greedy_text(tmp_path):
    model = make_tiny_qwen3(tmp_path / "tiny-moe", MOE_SHAPES["moe_top8_sharded"])
    config = tmp_path / "cpu.yaml"
    config.write_text("device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 16\ncpu_kv_cache_gib: 0.1\n"
                      "enforce_eager: true\nlog_level: INFO\nserver:\n  shutdown_grace_s: 2\n")
    server = launch(tmp_path, "moe", config, "--model", str(model))
    try:
        wait_ready(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        [listed] = client.models.list().data
        assert listed.id == "tiny-moe"
        tok = AutoTokenizer.from_pretrained(model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        for prompt in ["The quick brown fox", "What time is it?"]:
            ids = tok.encode(prompt, add_special_tokens=False)
            with torch.no_grad():
                want = tok.decode(hf_greedy(hf, ids, MAX_TOKENS), skip_special_tokens=True)
            r = client.completions.create(model=listed.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want, prompt
            assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens == len(ids)
            stream = client.completions.create(model=listed.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
        # Seeded sampling through the MoE model is reproducible.
        sampled = [client.completions.create(model=listed.id, prompt="Once upon", max_tokens=MAX_TOKENS,
                                             temperature=1.0, seed=7, extra_body={"ignore_eos": True}).choices[0].text
                   for _ in range(2)]
        assert sampled[0] == sampled[1]
    finally:
        kill(server)
