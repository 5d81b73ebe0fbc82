"""The HTTP API against a fake engine: request mapping, errors, auth, SSE, usage, metrics, disconnects.

The fake implements the engine interface the server uses (SyncEngine: tokenize,
add_request, abort, step, has_unfinished, stats) with the real tiny-model
tokenizer and a fixed token pattern, so every expected text below is computed
independently from the tokenizer; :func:`fake_model_info` describes its model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rtp.config import load_config
from rtp.errors import RequestError
from rtp.outputs import RequestOutput
from rtp.runtime.model_info import ModelInfo
from rtp.sampling import SamplingParams
from rtp.server import AsyncEngine, build_app
from rtp.testing import default_model_dir

MODEL = "fake-model"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def pattern_ids(tokenizer) -> list[int]:
    """The tokens the fake generates, in a cycle."""
    return tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)


class FakeEngine:
    """One token per request per step from a fixed cycle; records what the server asked for."""

    def __init__(self, tokenizer, step_delay_s: float = 0.0) -> None:
        self.tokenizer, self.max_model_len, self.model_dir = tokenizer, MAX_MODEL_LEN, Path("/models") / MODEL
        self.step_delay_s = step_delay_s
        self.pattern = pattern_ids(tokenizer)
        self.added: list[tuple[list[int], SamplingParams, str]] = []
        self.aborted: list[str] = []
        self.max_batch = 0
        self.fail_tokenize: Exception | None = None
        self.tokenize_delay_s = 0.0  # a slow tokenizer (a huge prompt)
        self.refuse_at_step: str | None = None  # finish new requests at their first step with this error
        self._lock = threading.Lock()
        self._live: dict[str, RequestOutput] = {}
        self._params: dict[str, SamplingParams] = {}
        self._pending_aborts: list[str] = []
        self.hold_partial_chars = False  # as the real detokenizer: text ending in part of a character waits

    def tokenize(self, prompt):
        if self.fail_tokenize is not None:
            raise self.fail_tokenize
        time.sleep(self.tokenize_delay_s)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    def add_request(self, prompt, params=None, request_id=None):
        ids = self.tokenize(prompt)
        if len(ids) + (params.max_tokens or 1) > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens exceeds max_model_len={self.max_model_len}")
        with self._lock:
            self.added.append((ids, params, request_id))
            self._live[request_id] = RequestOutput(request_id, None, ids, arrival_time=time.time(),
                                                   logprobs=[] if params.logprobs is not None else None)
            self._params[request_id] = params
        return request_id

    def abort(self, request_id):
        with self._lock:
            self.aborted.append(request_id)
            self._pending_aborts.append(request_id)

    def has_unfinished(self):
        with self._lock:
            return bool(self._live) or bool(self._pending_aborts)

    def step(self):
        time.sleep(self.step_delay_s)
        with self._lock:
            for rid in self._pending_aborts:
                self._live.pop(rid, None)
            self._pending_aborts.clear()
            self.max_batch = max(self.max_batch, len(self._live))
            outs = []
            for rid, out in list(self._live.items()):
                params = self._params[rid]
                if self.refuse_at_step is not None:
                    out.finish_reason, out.error, out.finish_time = "abort", self.refuse_at_step, time.time()
                    del self._live[rid]
                    outs.append(out)
                    continue
                token = self.pattern[len(out.token_ids) % len(self.pattern)]
                out.token_ids.append(token)
                out.new_token_ids = [token]
                if out.logprobs is not None:
                    out.logprobs.append({token: -0.25, (token + 1) % 500: -1.5, (token + 2) % 500: -2.5})
                out.first_token_time = out.first_token_time or time.time()
                new_text = self.tokenizer.decode(out.token_ids)
                if self.hold_partial_chars:
                    new_text = new_text.rstrip("\ufffd")
                out.new_text, out.text = new_text[len(out.text):], new_text
                if len(out.token_ids) >= params.max_tokens:
                    out.finish_reason, out.finish_time = "length", time.time()
                    del self._live[rid]
                outs.append(out)
            return outs

    def stats(self):
        with self._lock:
            n = len(self._live)
        return {"num_running": n, "num_waiting": 0, "kv_usage": n / 8, "num_blocks": 8,
                "prefix_query_tokens": 10, "prefix_hit_tokens": 4, "num_preemptions": 0}


def fake_model_info(engine: FakeEngine) -> ModelInfo:
    """The fake's model as the server sees it: the tokenizer's own size and EOS."""
    tok = engine.tokenizer
    return ModelInfo(MODEL, tok, len(tok), [tok.eos_token_id], engine.max_model_len)


def expected_text(tokenizer, n: int) -> str:
    p = pattern_ids(tokenizer)
    return tokenizer.decode([p[i % len(p)] for i in range(n)])


def make_app(tokenizer, step_delay_s: float = 0.0, sampling_defaults: dict | None = None, **server):
    engine = FakeEngine(tokenizer, step_delay_s)
    config = load_config(None, server={"max_tokens_limit": 40, "default_max_tokens": 12, **server})
    async_engine = AsyncEngine(engine)
    info = dataclasses.replace(fake_model_info(engine), sampling_defaults=sampling_defaults or {})
    return build_app(async_engine, config, info), engine, async_engine


@pytest.fixture
def served(tokenizer):
    app, engine, async_engine = make_app(tokenizer)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine, async_engine


def sse_events(text: str) -> list:
    """Parse an SSE body: every event is 'data: ...' followed by a blank line."""
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------- happy paths


def test_completion_text_usage_and_default_max_tokens(served, tokenizer):
    client, engine, _ = served
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids, params, rid = engine.added[-1]
    assert params.max_tokens == 12 and params.temperature == 0.0  # server.default_max_tokens
    assert body["id"] == rid and rid.startswith("cmpl-") and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == expected_text(tokenizer, 12) and choice["finish_reason"] == "length"
    assert ids == tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == len(ids) + 12


def test_request_fields_map_to_sampling_params(served):
    client, engine, _ = served
    r = client.post("/v1/completions", json={
        "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 11, "stop": ["x", "yz"],
        "top_k": 4, "min_p": 0.1, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [9], "user": "u",
        "some_future_field": {"ignored": True}, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
    })
    assert r.status_code == 200, r.text
    ids, p, _ = engine.added[-1]
    assert ids == [5, 6, 7]
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.min_p, p.min_tokens, p.ignore_eos,
            p.stop_token_ids, p.logprobs) == (3, 0.5, 0.9, 11, ["x", "yz"], 4, 0.1, 1, True, [9], None)


def test_the_models_sampling_defaults_fill_only_what_a_request_leaves_unset(tokenizer):
    # Qwen3's generation_config.json, plus a max_new_tokens (HF's name for max_tokens)
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    app, engine, _ = make_app(tokenizer, sampling_defaults=defaults)
    with TestClient(app) as client:
        for path, body in (("/v1/completions", {"prompt": "a"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
            assert client.post(path, json=body).status_code == 200
            p = engine.added[-1][1]
            assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.0, 5), path
        r = client.post("/v1/completions", json={"prompt": "a", "temperature": 0, "top_k": -1, "max_tokens": 9})
        assert r.status_code == 200
        p = engine.added[-1][1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.95, -1, 9)  # the request's own values win
        r = client.post("/v1/responses", json={"input": "a"})  # a Response repeats the settings it ran with
        assert r.status_code == 200 and (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.95)
        assert engine.added[-1][1].temperature == 0.6
        r = client.post("/v1/responses", json={"input": "a", "temperature": 0.3})
        assert r.status_code == 200 and (r.json()["temperature"], r.json()["top_p"]) == (0.3, 0.95)
        assert (engine.added[-1][1].temperature, engine.added[-1][1].top_p) == (0.3, 0.95)
    app, engine, _ = make_app(tokenizer)  # no defaults: rtp's (the OpenAI API's) temperature 1.0
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
        p = engine.added[-1][1]
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, -1, 12)  # 12: default_max_tokens
    app, engine, _ = make_app(tokenizer, sampling_defaults={"max_tokens": 100})  # above max_tokens_limit 40
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
        assert engine.added[-1][1].max_tokens == 40  # the checkpoint's default is held to the server's limit


def test_chat_applies_template_and_maps_chat_fields(served, tokenizer):
    client, engine, _ = served
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 5,
                                                  "max_tokens": 9, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    ids, p, rid = engine.added[-1]
    want = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi there"}],
                                         add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode(want, add_special_tokens=False)
    assert p.max_tokens == 5 and p.logprobs == 2  # max_completion_tokens wins over max_tokens
    body = r.json()
    assert body["id"] == rid and rid.startswith("chatcmpl-") and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": expected_text(tokenizer, 5)}
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] == -0.25 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]


def test_chat_template_switches_and_vllm_sampling_fields_reach_the_engine(served, tokenizer):
    client, engine, _ = served
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    cases = [({}, dict(add_generation_prompt=True)),
             ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
             ({"add_generation_prompt": False, "continue_final_message": True},
              dict(add_generation_prompt=False, continue_final_message=True))]
    prompts = []
    for fields, template in cases:
        r = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text
        want = tokenizer.apply_chat_template(turns, tokenize=False, **template)
        assert engine.added[-1][0] == tokenizer.encode(want, add_special_tokens=False)
        prompts.append(want)
    assert len(set(prompts)) == 3 and prompts[2].endswith("Well")  # the assistant's message left open
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stop": ["x"], "seed": -5,
                                             "include_stop_str_in_output": True})
    assert r.status_code == 200, r.text
    params = engine.added[-1][1]
    assert params.include_stop_str_in_output and params.stop_strings == ["x"] and params.seed == -5


def test_truncate_prompt_tokens_keeps_the_end_before_max_tokens_is_fitted(served, tokenizer):
    client, engine, _ = served
    prompt = list(range(1, 2 * MAX_MODEL_LEN))  # longer than the context
    r = client.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    ids, params, _ = engine.added[-1]
    assert ids == prompt[-8:] and params.truncate_prompt_tokens == 8 and params.max_tokens == 12
    assert r.json()["usage"]["prompt_tokens"] == 8
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b c d e f"}],
                                                  "truncate_prompt_tokens": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(engine.added[-1][0]) == 2
    for echoed in (prompt, "a b c d e f g h i j k l"):  # echo returns the tokens kept, with their logprobs
        r = client.post("/v1/completions", json={"prompt": echoed, "truncate_prompt_tokens": 3, "max_tokens": 2,
                                                 "echo": True, "logprobs": 0})
        kept = engine.added[-1][0]
        choice = r.json()["choices"][0]
        assert len(kept) == 3 and choice["text"] == tokenizer.decode(kept) + expected_text(tokenizer, 2)
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    for bad in (0, -2, MAX_MODEL_LEN, MAX_MODEL_LEN + 1):  # a positive k leaving room for a token, or -1
        r = client.post("/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_truncate_prompt_tokens_minus_one_fits_the_prompt_to_the_context(served):
    """-1: fit the prompt to the model's context. A prompt that fits is kept whole (both routes); a longer one
    keeps its last max_model_len - max_tokens tokens (max_model_len - 1 without max_tokens, as vLLM's: the default
    max_tokens then shrinks to the one token left)."""
    client, engine, _ = served
    prompt = list(range(1, 11))
    r = client.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": -1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    ids, params, _ = engine.added[-1]
    assert ids == prompt and params.truncate_prompt_tokens == -1
    chat = {"messages": [{"role": "user", "content": "a b c d e f"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    whole = engine.added[-1][0]
    assert client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": -1}).status_code == 200
    assert engine.added[-1][0] == whole
    long = list(range(1, 2 * MAX_MODEL_LEN))
    for max_tokens, kept in ((5, MAX_MODEL_LEN - 5), (None, MAX_MODEL_LEN - 1)):
        body = {"prompt": long, "truncate_prompt_tokens": -1, **({"max_tokens": max_tokens} if max_tokens else {})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ids, params, _ = engine.added[-1]
        assert ids == long[-kept:] and params.max_tokens == MAX_MODEL_LEN - kept
        assert r.json()["usage"]["prompt_tokens"] == kept


def test_tool_choice_errors_say_what_a_choice_is_and_call_arguments_may_be_an_object(served, tokenizer):
    client, engine, _ = served
    r = client.post("/v1/chat/completions", json={"messages": MSG, "tool_choice": {"type": "function"}})
    message = r.json()["error"]["message"]
    assert 'a named tool_choice is {"type": "function", "function": {"name": ...}}: function: Field' in message
    r = client.post("/v1/chat/completions", json={"messages": MSG, "tool_choice": "any"})
    assert 'must be "none", "auto", "required" or' in r.json()["error"]["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    as_text = {**call, "function": {"name": "f", "arguments": '{"x": 1}'}}
    prompts = []
    for c in (call, as_text):  # an object is taken as its JSON text, as vLLM does
        turns = [*MSG, {"role": "assistant", "content": None, "tool_calls": [c]}]
        r = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 1})
        assert r.status_code == 200, r.text
        prompts.append(engine.added[-1][0])
    assert prompts[0] == prompts[1]


def test_completion_logprobs_shape(served):
    client, _, _ = served
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(t) == 1 for t in lp["top_logprobs"]) and lp["token_logprobs"] == [-0.25] * 4
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]


def test_logprobs_of_tokens_holding_part_of_a_character(tokenizer):
    """Byte-level tokens that each hold part of a character: chat's ``bytes`` are the tokens' own bytes (they
    rebuild the text; the token strings are U+FFFD), and completions' ``text_offset`` point into the text (the
    character a token ends or continues), streamed or not, after an echoed prompt too."""
    app, engine, _ = make_app(tokenizer)
    engine.pattern = tokenizer.encode("\u65e5\u00e9, the \N{ROCKET}", add_special_tokens=False)
    engine.hold_partial_chars = True
    n, prompt = len(engine.pattern), "Now \u65e5\u00e9"
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert n > len("\u65e5\u00e9, the \N{ROCKET}") and len(prompt_ids) > len(prompt)  # characters span tokens

    def starts(ids: list[int]) -> list[int]:  # each token's offset: the complete characters before it
        return [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]

    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": n, "logprobs": True, "top_logprobs": 2})
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in content) == choice["message"]["content"].encode()
        assert "\ufffd" in [e["token"] for e in content]
        for entry in content + [top for e in content for top in e["top_logprobs"]]:
            assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"]
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "logprobs": 1, "echo": True})
        choice = r.json()["choices"][0]
        assert choice["text"] == prompt + tokenizer.decode(engine.pattern)
        assert choice["logprobs"]["text_offset"] == starts(prompt_ids) + [len(prompt) + o for o in
                                                                          starts(engine.pattern)]
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": n, "logprobs": 0, "stream": True})
        offsets = [o for c in sse_events(r.text)[:-1] for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == starts(engine.pattern)


def test_default_max_tokens_shrinks_to_fit_the_context(served):
    client, engine, _ = served
    prompt = list(range(1, MAX_MODEL_LEN - 4))  # 59 tokens leave 5 of context; the default is 12
    r = client.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    assert engine.added[-1][1].max_tokens == 5 and r.json()["usage"]["completion_tokens"] == 5


def test_models_and_health(served):
    client, _, async_engine = served
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == MODEL and card["parent"] is None  # vLLM's fields
    assert client.get(f"/v1/models/{MODEL}").status_code == 200
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == client.post("/ping").status_code == 200  # vLLM's other name
    async_engine.fail("rank 1 (pid 1) died")
    r = client.get("/health")
    assert r.status_code == 503 and "rank 1" in r.json()["reason"]
    assert client.post("/ping").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_health_is_503_before_startup(tokenizer):
    app, _, _ = make_app(tokenizer)
    client = TestClient(app)  # no `with`: the lifespan (engine thread) has not started
    assert client.get("/health").status_code == 503


def test_requests_are_batched_together(tokenizer):
    app, engine, _ = make_app(tokenizer, step_delay_s=0.01)
    with TestClient(app) as client:
        threads = [threading.Thread(target=client.post, args=("/v1/completions",),
                                    kwargs={"json": {"prompt": "a", "max_tokens": 20}}) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(engine.added) == 4 and engine.max_batch >= 2


# ---------------------------------------------------------------------------- streaming


def test_completion_stream_format_and_usage(served, tokenizer):
    client, engine, _ = served
    with client.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 7, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["prompt_tokens"] == len(engine.added[-1][0])
    assert all(c["object"] == "text_completion" and c["id"] == engine.added[-1][2] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(tokenizer, 7)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served, tokenizer):
    client, engine, _ = served
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/completions", {"prompt": ["Hello", "Hi there"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "max_tokens": 5, "stream": True, "stream_options": options})
        *chunks, final = sse_events(r.text)[:-1]
        assert final["choices"] == [] and chunks and all("usage" in c for c in chunks)
        count = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(ids) for ids, _, _ in engine.added[-count:]}
        usages = [c["usage"] for c in chunks]
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        if path.endswith("chat/completions"):
            assert done[0] == 0 and done == sorted(done)  # the role chunk, then the tokens so far
        assert max(done) == 5 and final["usage"]["completion_tokens"] == 5 * count
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True,
                                             "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in sse_events(r.text)[:-1])  # only with include_usage, as in vLLM


def test_chat_echo_prepends_the_assistants_last_message(served, tokenizer):
    client, _, _ = served
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"messages": turns, "max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert plain == expected_text(tokenizer, 4) and echoed["content"] == "Well," + plain
    chunks = sse_events(client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True}).text)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Well," + plain
    user_last = {"messages": turns[:1], "max_tokens": 4, "echo": True}  # only the reply's own role is echoed
    assert client.post("/v1/chat/completions", json=user_last).json()["choices"][0]["message"]["content"] == plain


def test_chat_stream_format_without_usage(served, tokenizer):
    client, _, _ = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 6, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected_text(tokenizer, 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_token_whose_text_is_held_back_still_gets_its_chunk(tokenizer):
    """A token that ends in part of a character has no text yet; its chunk comes at once, with empty text (as
    vLLM's server streams it): a client sees its first token when it is made, and the text follows."""
    app, engine, _ = make_app(tokenizer, step_delay_s=0.02)
    engine.pattern = tokenizer.encode("\N{ROCKET} sat", add_special_tokens=False)  # the rocket: 4 tokens
    engine.hold_partial_chars = True
    n = len(engine.pattern)
    usage = {"include_usage": True, "continuous_usage_stats": True}  # each chunk: the tokens made so far
    with TestClient(app) as client:
        for path, body, text_of in (
                ("/v1/completions", {"prompt": "Hi"}, lambda c: c["text"]),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                 lambda c: c["delta"].get("content", ""))):
            r = client.post(path, json={**body, "max_tokens": n, "stream": True, "stream_options": usage})
            chunks = [c for c in sse_events(r.text)[:-2] if "role" not in c["choices"][0].get("delta", {})]
            made = [c["usage"]["completion_tokens"] for c in chunks]
            texts = [text_of(c["choices"][0]) for c in chunks]
            assert texts[0] == "" and made[0] == 1  # the first step's token, its text not made yet
            assert made[-1] == n and "".join(texts) == tokenizer.decode(engine.pattern)


def test_engine_failure_ends_a_stream_with_an_error_event(tokenizer):
    app, engine, async_engine = make_app(tokenizer, step_delay_s=0.05)
    with TestClient(app) as client:
        threading.Timer(0.3, async_engine.fail, args=("rank 1 (pid 7) died",)).start()
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 40, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "rank 1" in events[-2]["error"]["message"] and events[-2]["error"]["type"] == "server_error"
        assert engine.added[-1][2] in engine.aborted  # the unfinished request was aborted


def test_a_slow_tokenization_does_not_block_the_event_loop(served):
    client, engine, _ = served
    engine.tokenize_delay_s = 1.5
    slow: dict = {}
    t = threading.Thread(target=lambda: slow.update(r=client.post("/v1/completions",
                                                                   json={"prompt": "a", "max_tokens": 2})))
    t.start()
    time.sleep(0.3)  # the request is being tokenized now
    t0 = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - t0 < 1.0  # answered while the tokenizer works (1.2 s more), not after it
    t.join(30)
    assert slow["r"].status_code == 200 and slow["r"].json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------- bad input

MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b"\xff\xfe", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", b"", 400, None),
    ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),  # allowed with echo only
    ("completions", {"prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 1}, 400, "min_tokens"),
    ("chat/completions", {"messages": MSG, "max_tokens": 0, "echo": True}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 41}, 400, "max_tokens"),  # over server.max_tokens_limit
    ("completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "temperature": True}, 400, "temperature"),
    ("completions", {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),  # not "above 2": not a number
    ("completions", b'{"prompt": "a", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    ("completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "a", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "a", "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": "a", "n": 129}, 400, "n"),
    ("completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("completions", {"prompt": "a", "logit_bias": {"five": 1.0}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "echo": "yes"}, 400, "echo"),
    ("completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", b'{"prompt": ["a", "b\\ud800"]}', 400, "prompt.1"),  # JSON's lone surrogate: no UTF-8
    ("completions", b'{"prompt": "a", "stop": "\xed\xa0\x80"}', 400, "stop"),  # the same, as raw bytes
    ("completions", b'{"prompt": "\\ud83d\\ude80 \\\\ud800", "max_tokens": 2}', 200, None),  # a pair; no escape
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages.0.content"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": {"properties": {"\\ud800": {}}}}}]}', 400,
     "tools.0.function.parameters.properties.\\ud800"),  # a key: named escaped
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": ["a", [1, 2]]}, 400, "prompt"),  # a list of prompts is all texts or all ids
    ("completions", {"prompt": [1, "b"]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt"),  # longer than the context
    ("completions", {"prompt": list(range(1, 60)), "max_tokens": 10}, 400, "max_tokens"),  # 59 + 10 > 64
    ("completions", {"prompt": "a", "max_tokens": 40, "temperature": 0, "stream": True,
                     "prompt_pad": "x"}, 200, None),  # unknown fields are ignored
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content.0.type"),
    ("chat/completions", {"messages": MSG, "logprobs": 1}, 400, "logprobs"),
    ("chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": MSG, "max_completion_tokens": 41}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("chat/completions", {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {"messages": MSG, "tool_choice": {"type": "function"}}, 400, "tool_choice"),
    ("chat/completions", {"messages": MSG, "tool_choice": "any"}, 400, "tool_choice"),
    ("chat/completions", {"messages": MSG, "guided_regex": "([a-"}, 400, "guided_regex"),
    ("chat/completions", {"messages": MSG, "guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, 400,
     "structured_outputs.choice"),
    ("completions", {"prompt": "a", "guided_json": {"type": "no-such-type"}}, 400, "guided_json"),
    ("chat/completions", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("chat/completions", {"messages": MSG, "chat_template": "{{ messages }}"}, 400, "chat_template"),  # not ignored
    ("chat/completions", {"messages": MSG, "model": "nope"}, 404, "model"),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "a", "seed": 2**64}, 400, "seed"),
    ("completions", {"prompt": "a", "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text"),
    ("chat/completions", {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message"),
    ("chat/completions", {"messages": MSG, "continue_final_message": True, "add_generation_prompt": False}, 400,
     "continue_final_message"),  # the last message is the user's
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_generate_nothing(served, endpoint, body, status, param):
    client, engine, _ = served
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(f"/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:
        assert engine.added
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert "Traceback" not in r.text
    assert engine.added == []
    # The server keeps serving.
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_a_number_that_is_not_finite_is_named_so(served):
    client, engine, _ = served
    for body in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "logit_bias": {"5": -Infinity}}'):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "finite number" in r.json()["error"]["message"], r.text
    assert not engine.added


def test_body_over_the_limit_is_413(tokenizer):
    app, engine, _ = make_app(tokenizer, max_request_bytes=1000)
    with TestClient(app) as client:
        big = json.dumps({"prompt": "a" * 2000}).encode()
        r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"a" * 100
            yield b'"}'

        r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert engine.added == []
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_unexpected_errors_are_a_generic_500(served, caplog):
    client, engine, _ = served
    engine.fail_tokenize = RuntimeError("secret internal detail")
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret internal detail" in caplog.text  # the details go to the log
    assert client.get("/v1/unknown").status_code == 404
    assert client.get("/v1/unknown").json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- auth


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2"])
def test_api_key_is_required(tokenizer, header):
    app, engine, _ = make_app(tokenizer, api_key="s3cret")
    with TestClient(app) as client:
        headers = {"Authorization": header} if header else {}
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/metrics")]:
            r = client.request(method, path, headers=headers, json={"prompt": "a", "messages": MSG})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert engine.added == []
        assert client.get("/health").status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", headers=good, json={"prompt": "a", "max_tokens": 2}).status_code == 200
        assert client.get("/metrics", headers=good).status_code == 200


# ---------------------------------------------------------------------------- metrics


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_tokens_and_latencies(served):
    client, engine, _ = served
    before = client.get("/metrics").text
    assert metric(before, "rtp_generation_tokens_total") == 0
    client.post("/v1/completions", json={"prompt": "one two", "max_tokens": 5})
    client.post("/v1/completions", json={"prompt": "three", "max_tokens": 3, "stream": True})
    text = client.get("/metrics").text
    prompt_tokens = sum(len(ids) for ids, _, _ in engine.added)
    assert metric(text, "rtp_generation_tokens_total") == 8
    assert metric(text, "rtp_prompt_tokens_total") == prompt_tokens
    assert metric(text, "rtp_time_to_first_token_seconds_count") == 2
    assert metric(text, "rtp_e2e_request_latency_seconds_count") == 2
    assert metric(text, "rtp_inter_token_latency_seconds_count") == 8 - 2  # gaps after the first tokens
    assert metric(text, 'rtp_requests_finished_total{finish_reason="length"}') == 2
    assert metric(text, "rtp_prefix_cache_hit_rate") == pytest.approx(0.4)
    assert metric(text, "rtp_kv_cache_usage_ratio") == 0.0  # nothing running any more
    assert metric(text, "rtp_requests_running") == 0


def test_separate_apps_have_separate_registries(tokenizer):
    a, _, _ = make_app(tokenizer)
    b, _, _ = make_app(tokenizer)
    with TestClient(a) as ca, TestClient(b) as cb:
        ca.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert metric(ca.get("/metrics").text, "rtp_generation_tokens_total") == 2
        assert metric(cb.get("/metrics").text, "rtp_generation_tokens_total") == 0


# ---------------------------------------------------------------------------- disconnects


async def call_asgi(app, path: str, body: dict, disconnect_when) -> list[dict]:
    """Drive the ASGI app directly; the client "disconnects" once disconnect_when(sent) is true.

    ``disconnect_when=None``: the client is gone as soon as its request body was read.
    """
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    gone = asyncio.Event()
    delivered = False
    if disconnect_when is None:
        gone.set()
        disconnect_when = bool

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if disconnect_when(sent):
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80), "state": {}}
    asyncio.get_running_loop().call_later(0.3, gone.set)  # non-streaming: leave while it is generating
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def after_two_chunks(sent: list[dict]) -> bool:
    return sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body")) >= 2


@pytest.mark.parametrize("stream,disconnect_when", [
    (True, after_two_chunks),  # while tokens stream
    (True, lambda sent: True),  # as soon as the response starts, before any event
    (True, None),  # gone before the response starts: the event generator never runs
    (False, lambda sent: False),  # while a non-streaming request generates (the 0.3 s timer)
])
def test_client_disconnect_aborts_the_request(tokenizer, stream, disconnect_when):
    app, engine, async_engine = make_app(tokenizer, step_delay_s=0.02)
    async_engine.start()
    try:
        body = {"prompt": "a", "max_tokens": 40, "stream": stream}
        sent = asyncio.run(call_asgi(app, "/v1/completions", body, disconnect_when))
        rid = engine.added[0][2]
        assert rid in engine.aborted
        deadline = time.time() + 5
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished()  # the abort reached the engine: nothing left running
        text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b"[DONE]" not in text and b'"length"' not in text
    finally:
        async_engine.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_refuses_later_is_a_400(served, stream):
    client, engine, _ = served
    engine.refuse_at_step = "needs 9 KV blocks but the cache has only 8"
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": stream})
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "KV blocks" in events[-2]["error"]["message"]
    else:
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]


def test_a_chat_stream_opens_with_its_first_output(tokenizer):
    """The role chunk goes with the first token, as vLLM's (a client that times the first chunk times the
    first token); a request refused before it has made one streams the error alone."""
    app, engine, _ = make_app(tokenizer, step_delay_s=0.25)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with TestClient(app) as client:
        arrivals = []
        start = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic() - start, json.loads(line[6:])["choices"][0]["delta"]))
        assert "role" in arrivals[0][1] and arrivals[0][0] >= 0.2  # not before the first step's 0.25 s
        assert "content" in arrivals[1][1] and arrivals[1][0] - arrivals[0][0] < 0.2  # that step's token
        engine.refuse_at_step = "needs 9 KV blocks but the cache has only 8"
        events = sse_events(client.post("/v1/chat/completions", json=body).text)
        assert len(events) == 2 and "KV blocks" in events[0]["error"]["message"]


def test_a_crashed_engine_thread_fails_requests_and_health(tokenizer):
    app, engine, async_engine = make_app(tokenizer)
    died: list[str] = []
    async_engine.on_dead.append(died.append)

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert r.status_code == 503 and "RuntimeError" in r.json()["error"]["message"]
        assert "boom" not in r.text  # the details stay in the log
        assert client.get("/health").status_code == 503
        assert died and "RuntimeError" in died[0]


@pytest.mark.parametrize("lost", [True, False], ids=["rank-lost", "all-alive"])
def test_the_server_stopping_first_asks_whether_a_rank_is_gone(caplog, lost: bool) -> None:
    """torchrun sends SIGTERM to the surviving ranks when one dies: the single-process server, stopping, asks the
    runtime first (which, finding the rank gone, fails every request with its name) and says which stop it is."""
    from types import SimpleNamespace

    import uvicorn

    from rtp.server.runner import GracefulServer, bind_socket

    async def app(scope, receive, send) -> None:  # noqa: ANN001 - never called: no request is made
        raise AssertionError("no request expected")

    asked: list[bool] = []

    def lost_peer() -> bool:
        asked.append(lost)
        return lost

    server = GracefulServer(uvicorn.Config(app, lifespan="off", log_config=None), SimpleNamespace(abort_all=lambda: 0),
                            None, 5.0, lost_peer=lost_peer)
    sock = bind_socket("127.0.0.1", 0)

    async def serve_then_stop() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        await asyncio.wait_for(task, 10)

    with caplog.at_level("INFO", logger="rtp"):
        try:
            asyncio.run(serve_then_stop())
        finally:
            sock.close()
    assert asked == [lost]
    said = "stopping after a rank was lost" if lost else "running requests have 5 s to finish"
    assert said in caplog.text
