"""Speculative decoding through the server (one API frontend, the openai client): a json_schema grammar,
penalties and logprobs in one request; the text and logprobs equal rtp's without speculation (the
in-process engine with the same grammar), the JSON is valid, and drafts were accepted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from rtp.sampling import SamplingParams
from tests.server.test_serve_e2e import Server, kill, wait_ready
from tests.spec.test_spec_engine import make_engine, run
from tests.utils import REPO

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"lines": {"type": "array", "items": {"enum": ["the king", "the queen"]},
                                                      "minItems": 6, "maxItems": 10}},
          "required": ["lines"], "additionalProperties": False}
PROMPT = "the king, the king, the king, the king, and the king's son, the king"


@pytest.mark.timeout(600)
def test_json_schema_penalties_logprobs_with_speculation_equal_the_run_without(tmp_path):
    pytest.importorskip("xgrammar")
    from rtp.assets import trained_model_dir
    from rtp.structured import GrammarCompiler, GrammarSpec

    config = tmp_path / "c.yaml"
    config.write_text("device: cpu\ndtype: float32\nblock_size: 16\ncpu_kv_cache_gib: 0.25\nenforce_eager: true\n"
                      "log_level: INFO\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/serve.py",
           "--config", str(config), "--port", "0",
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, log)
    try:
        wait_ready(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=150,
                                      temperature=0, presence_penalty=0.2, logprobs=2,
                                      extra_body={"guided_json": SCHEMA, "repetition_penalty": 1.05})
        text = httpx.get(server.url + "/metrics").text
    finally:
        kill(server)
    choice = r.choices[0]
    assert json.loads(choice.text)["lines"]  # valid JSON of the schema
    accepted = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0

    md = trained_model_dir()
    engine = make_engine(md)
    compiler = GrammarCompiler(engine.tokenizer, engine.model_info.vocab_size, list(engine.eos_token_ids))
    spec = GrammarSpec.json_schema(SCHEMA, "guided_json")
    params = SamplingParams(temperature=0, max_tokens=150, presence_penalty=0.2, repetition_penalty=1.05, logprobs=2,
                            constraint=compiler.constraint_factory(compiler.compile(spec), spec))
    [want] = run(engine, [(engine.tokenize(PROMPT), params)])
    assert choice.text == want.text
    got_lps = choice.logprobs.token_logprobs
    want_lps = [lp[t] for lp, t in zip(want.logprobs, want.token_ids)]
    assert len(got_lps) == len(want_lps) and max(abs(a - b) for a, b in zip(got_lps, want_lps)) < 1e-4
