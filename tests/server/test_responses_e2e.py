"""`rtp serve MODEL` with vLLM-spelled flags (TP=2, tiny random model), driven by the openai client:
the Responses API (plain, streamed, reasoning, a function tool) and a list of prompts in
/v1/completions, each compared with transformers' greedy continuation.

One server for the module, started through the ``rtp`` console script as a new user would:
``rtp serve MODEL --tensor-parallel-size 2 --dtype float32 --max-num-seqs 32 ...`` (the rank count
comes from --tensor-parallel-size) with ``--reasoning-parser qwen3``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import Server, kill, wait_ready
from tests.utils import hf_greedy, rank_pids

pytestmark = pytest.mark.slow

RTP = Path(sys.executable).with_name("rtp")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
PROMPTS = ["The quick brown fox", "Once upon a time", "What time is it?", "A"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not RTP.exists():
        pytest.fail(f"{RTP} is missing: install rtp (pip install -e .) to get the `rtp` console script")
    tmp = tmp_path_factory.mktemp("responses")
    config = tmp / "cpu.yaml"
    config.write_text("device: cpu\nblock_size: 16\ncpu_kv_cache_gib: 0.1\nenforce_eager: true\nlog_level: INFO\n"
                      "server:\n  shutdown_grace_s: 2\n")
    log = tmp / "serve.log"
    cmd = [str(RTP), "serve", str(default_model_dir()), "--tensor-parallel-size", "2", "--dtype", "float32",
           "--max-num-seqs", "32", "--config", str(config), "--port", "0", "--reasoning-parser", "qwen3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    s = Server(proc, log)
    try:
        wait_ready(s)
        yield s
    finally:
        kill(s)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf():
    m = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(str(default_model_dir()))


def chat_prompt(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_two_ranks_from_the_tensor_parallel_size_flag(server):
    assert sorted(rank_pids(server.proc.pid)) == [0, 1]


@pytest.mark.timeout(120)
def test_responses_plain_and_streamed_equal_transformers_greedy(client, model, hf):
    m, tok = hf
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    want = tok.decode(hf_greedy(m, chat_prompt(tok, messages), 8))
    extra = {"ignore_eos": True}
    r = client.responses.create(model=model, input="Name a colour.", instructions="Be terse.", max_output_tokens=8,
                                temperature=0, extra_body=extra)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    text = "".join(i.content[0].text for i in r.output if i.type == "message")
    reasoning = [i for i in r.output if i.type == "reasoning"]
    # The random model never writes <think>: the reasoning parser passes all of it on as the answer.
    assert not reasoning and text == want and r.usage.output_tokens == 8
    events = list(client.responses.create(model=model, input=[{"role": "system", "content": "Be terse."},
                                                              {"role": "user", "content": "Name a colour."}],
                                          max_output_tokens=8, temperature=0, stream=True, extra_body=extra))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want


@pytest.mark.timeout(120)
def test_included_output_text_logprobs_equal_transformers_log_softmax(client, model, hf):
    m, tok = hf
    prompt = chat_prompt(tok, [{"role": "user", "content": "Count to five."}])
    want = hf_greedy(m, prompt, 6)
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([prompt + want])).logits[0].double(), -1)[len(prompt) - 1:]  # [7, vocab]
    r = client.responses.create(model=model, input="Count to five.", max_output_tokens=6, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=3,
                                extra_body={"ignore_eos": True})
    logprobs = r.output[-1].content[0].logprobs
    assert len(logprobs) == 6
    for i, (entry, token) in enumerate(zip(logprobs, want, strict=True)):
        assert entry.token == tok.decode([token]) and abs(entry.logprob - ref[i, token].item()) < 1e-4, i
        top = torch.topk(ref[i], 3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([k]) for k in top.indices.tolist()], i
        assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(entry.top_logprobs, top.values.tolist(), strict=True))


@pytest.mark.timeout(180)
def test_responses_with_a_function_tool(client, model):
    # "required" is a list of calls of any length: the random model may need a few hundred tokens to close it.
    # With --reasoning-parser the grammar applies after the think block, which the random model never closes:
    # the prompt closes it (enable_thinking false), so the grammar applies from the start.
    no_think = {"seed": 6, "chat_template_kwargs": {"enable_thinking": False}}
    for choice, limit in (({"type": "function", "name": "get_weather"}, 200), ("required", 600)):
        r = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice=choice, max_output_tokens=limit, extra_body=no_think)
        calls = [i for i in r.output if i.type == "function_call"]
        assert r.status == "completed" and calls and all(c.name == "get_weather" for c in calls), r.output
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
            assert call.call_id.startswith("call_")
    events = list(client.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=200, extra_body=no_think))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].type == "function_call"


@pytest.mark.timeout(180)
def test_a_four_prompt_completion_equals_four_single_requests(client, model, hf):
    m, tok = hf
    extra = {"ignore_eos": True}
    batch = client.completions.create(model=model, prompt=PROMPTS, max_tokens=10, temperature=0, extra_body=extra)
    singles = [client.completions.create(model=model, prompt=p, max_tokens=10, temperature=0, extra_body=extra)
               for p in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert [c.text for c in batch.choices] == [tok.decode(hf_greedy(m, tok.encode(p), 10)) for p in PROMPTS]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 40
    # Streamed, with n=2 per prompt (seeded samples): index = prompt * 2 + sample.
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=6, n=2, seed=3,
                                            stream=True, extra_body=extra))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    single = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, n=2, seed=3, extra_body=extra)
    assert sorted(texts) == [0, 1, 2, 3] and [texts[2], texts[3]] == [c.text for c in single.choices]
