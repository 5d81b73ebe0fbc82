"""/v1/completions with a list of prompts, against the fake engine: indices, n, usage, streams, errors.

The fake generates the same token cycle for every request, so the texts are known from the
tokenizer alone; what differs per prompt is the prompt (its token count in usage, its echo).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.server.test_api import expected_text, make_app, sse_events

PROMPTS = ["Once upon a time", "The cat", "Hello there", "A"]


@pytest.fixture
def served(tokenizer):
    app, engine, async_engine = make_app(tokenizer)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rtp.testing import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def prompt_len(tokenizer, prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt, add_special_tokens=False))


def test_one_choice_per_prompt_in_index_order_with_summed_usage(served, tokenizer):
    client, engine = served
    r = client.post("/v1/completions", json={"prompt": ["Once upon a time", "The cat", "A"], "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == expected_text(tokenizer, 4) and c["finish_reason"] == "length" for c in body["choices"])
    # One engine request per prompt, in order, each with its own tokens.
    assert [ids for ids, _, _ in engine.added[-3:]] == [tokenizer.encode(p, add_special_tokens=False)
                                                          for p in ("Once upon a time", "The cat", "A")]
    prompt_tokens = sum(prompt_len(tokenizer, p) for p in ("Once upon a time", "The cat", "A"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12,
                             "total_tokens": prompt_tokens + 12, "prompt_tokens_details": {"cached_tokens": 0}}


def test_token_id_prompts_and_n_per_prompt(served, tokenizer):
    client, engine = served
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "n": 2, "echo": True})
    assert r.status_code == 200, r.text
    # The fake ignores n (one sample per request), so each prompt answers one choice, numbered i * n.
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 2]
    assert [ids for ids, _, _ in engine.added[-2:]] == [[5, 6, 7], [8, 9]]
    assert all(p.n == 2 for _, p, _ in engine.added[-2:])
    assert choices[0]["text"] == tokenizer.decode([5, 6, 7]) + expected_text(tokenizer, 3)  # each echoes its own
    assert choices[1]["text"] == tokenizer.decode([8, 9]) + expected_text(tokenizer, 3)


def test_streamed_prompts_carry_their_indices_and_one_usage_chunk(served, tokenizer):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 5, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage_chunks = [e for e in events[:-1] if e["choices"] == []]
    assert len(usage_chunks) == 1 and events[-2] is usage_chunks[0]
    text: dict[int, str] = {}
    finished = {}
    for e in events[:-2]:
        for c in e["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished[c["index"]] = c["finish_reason"]
    assert sorted(text) == [0, 1, 2, 3] and all(t == expected_text(tokenizer, 5) for t in text.values())
    assert finished == {i: "length" for i in range(4)}
    prompt_tokens = sum(prompt_len(tokenizer, p) for p in PROMPTS)
    assert usage_chunks[0]["usage"]["prompt_tokens"] == prompt_tokens
    assert usage_chunks[0]["usage"]["completion_tokens"] == 20
    assert len({e["id"] for e in events[:-1]}) == 1  # one response id for the whole request


def test_a_refused_prompt_fails_the_request_and_queues_nothing_of_it(served):
    client, engine = served
    before = len(engine.added)
    r = client.post("/v1/completions", json={"prompt": [[1, 2, 3], list(range(1, 200))], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text
    # The first prompt was queued before the second was refused: it is aborted, not left running.
    assert len(engine.added) == before + 1 and engine.added[-1][2] in engine.aborted


def test_prompt_list_bounds(served):
    client, _ = served
    for prompt in ([], [""], [[]], ["a"] * 257, ["a", [1, 2]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    assert "at most 256" in client.post("/v1/completions", json={"prompt": ["a"] * 257}).json()["error"]["message"]


def test_a_batch_of_one_is_the_single_prompt_response(served, tokenizer):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": ["Once upon a time"], "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
    assert json.dumps(body["choices"][0]["text"]) == json.dumps(expected_text(tokenizer, 3))
