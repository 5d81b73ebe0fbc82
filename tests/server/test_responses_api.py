"""/v1/responses against the fake engine, through the official openai client (its Responses types).

The prompt must be the chat template applied to instructions + input, the sampling fields must
reach SamplingParams, and the output, usage and stream events must be what the SDK parses.
Reasoning and tool-call items are checked on the writer with a ChatOutput fed known text.
"""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from rtp.sampling import SamplingParams
from rtp.server.chat_output import ChatOutput
from rtp.server.responses_api import ResponseWriter
from rtp.server.responses_protocol import ResponsesRequest
from tests.server.test_api import MODEL, expected_text, make_app


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rtp.testing import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture
def served(tokenizer):
    app, engine, _ = make_app(tokenizer)
    with TestClient(app, raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        yield client, http, engine


def template(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_plain_text_input_with_instructions(served, tokenizer):
    client, _, engine = served
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be terse.", max_output_tokens=5,
                                temperature=0.5, top_p=0.9)
    ids, params, _ = engine.added[-1]
    assert ids == template(tokenizer, [{"role": "system", "content": "Be terse."},
                                       {"role": "user", "content": "Name a colour."}])
    assert (params.max_tokens, params.temperature, params.top_p) == (5, 0.5, 0.9)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == expected_text(tokenizer, 5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 5 tokens ran out
    assert r.created_at == int(r.created_at)  # whole seconds, as OpenAI's
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == 5 and r.usage.total_tokens == len(ids) + 5
    assert r.instructions == "Be terse." and r.max_output_tokens == 5 and r.temperature == 0.5


def test_message_input_with_function_call_history(served, tokenizer):
    client, http, engine = served
    # The tool prompt is longer than the fake's 64-token context: widen it for this test.
    http.app.state.context.max_model_len = engine.max_model_len = 2048
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    client.responses.create(model=MODEL, input=items, max_output_tokens=3, tools=tools, tool_choice="none")
    ids, _, _ = engine.added[-1]
    # The output as text parts (the SDK's other shape) is the same prompt.
    items[2] = {**items[2], "output": [{"type": "input_text", "text": "ra"}, {"type": "input_text", "text": "in"}]}
    client.responses.create(model=MODEL, input=items, max_output_tokens=3, tools=tools, tool_choice="none")
    assert engine.added[-1][0] == ids
    chat_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
        tools=chat_tools, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_streamed_events_as_the_sdk_parses_them(served, tokenizer):
    client, _, _ = served
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected_text(tokenizer, 4)
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 4
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_output_text_logprobs_when_included_equal_the_chat_routes(served, tokenizer):
    client, http, engine = served
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 5, "temperature": 0}
    r = http.post("/v1/responses", json={**body, "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert r.status_code == 200, r.text
    assert engine.added[-1][1].logprobs == 2
    part = r.json()["output"][0]["content"][0]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 5, "temperature": 0, "logprobs": True,
                                                   "top_logprobs": 2})
    want = chat.json()["choices"][0]["logprobs"]["content"]
    assert part["logprobs"] == want and len(want) == 5
    p = engine.pattern
    for i, entry in enumerate(part["logprobs"]):  # the fake's: the token at -0.25, two others below it
        assert entry["token"] == tokenizer.decode([p[i % len(p)]]) and entry["logprob"] == -0.25
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25, -1.5]
    # Streamed: the deltas' logprobs add up to the done event's and to the non-streamed list.
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, temperature=0, stream=True,
                                          include=["message.output_text.logprobs"], top_logprobs=2))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = [e for e in events if e.type == "response.output_text.done"][0]
    assert streamed == [lp.model_dump() for lp in done.logprobs] == want
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == want
    # Not included: no logprobs computed, none listed (top_logprobs alone does not ask for them, as vLLM's).
    r = http.post("/v1/responses", json={**body, "top_logprobs": 2, "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200 and engine.added[-1][1].logprobs is None
    assert r.json()["output"][0]["content"][0]["logprobs"] == []


def test_bad_requests_get_400s_naming_the_field(served):
    _, http, _ = served
    for body, param in (({"input": ""}, "input"), ({"input": []}, "input"),
                        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
                        ({"input": [{"content": "no role"}]}, "input.0.role"),
                        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                                                  {"type": "input_image", "image_url": "x"}]}]},
                         "input.0.content.1.type"),  # text only, said so
                        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
                        ({"input": [{"role": "user", "content": "Hi"},
                                    {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
                         "input.1.call_id"),  # answers no call
                        ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "a", "max_output_tokens": 100_000}, "max_output_tokens"),  # over the limit
                        ({"input": "a", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
                        ({"input": "a", "model": "other"}, "model"),
                        ({"input": "a", "top_logprobs": 21}, "top_logprobs"),
                        ({"input": "a", "include": ["message.output_text.logprobs", "everything"]}, "include.1")):
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


def writer(output: ChatOutput) -> ResponseWriter:
    return ResponseWriter(ResponsesRequest(input="x"), "resp_1", MODEL, 3, output, SamplingParams())


def parse(events: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in events]


def test_reasoning_and_text_become_two_items_in_stream_and_in_full():
    w = writer(ChatOutput(reasoning=True))
    events = []
    for piece, final in (("<think>", False), ("plan it", False), ("</think>", False), ("Hello", False),
                         (" there", True)):
        events += parse(w.delta_events(w.output.delta(piece, final)))
    events += parse(w._finish_open())
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "plan it"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta").strip() == "Hello there"
    assert [i["type"] for i in w.items] == ["reasoning", "message"]
    full = writer(ChatOutput(reasoning=True))
    items = full.items_of(full.output.message("<think>plan it</think>Hello there"), "completed")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "plan it" and items[1]["content"][0]["text"].strip() == "Hello there"


def test_a_named_tool_choice_streams_one_function_call_item():
    w = writer(ChatOutput(tool_mode="named", tool_name="get_weather"))
    events = []
    for piece, final in (('{"city"', False), (': "Oslo"}', True)):
        events += parse(w.delta_events(w.output.delta(piece, final)))
    events += parse(w._finish_open())
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["type"] == "function_call" and added[0]["item"]["name"] == "get_weather"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[0]["arguments"]) == {"city": "Oslo"}
    assert w.items[0]["call_id"].startswith("call_") and w.items[0]["status"] == "completed"


def test_an_item_cut_off_by_max_output_tokens_is_incomplete_and_the_ones_before_it_completed():
    # Streamed: a reasoning item, then a named function call whose arguments ran out of tokens.
    w = writer(ChatOutput(reasoning=True, tool_mode="named", tool_name="get_weather"))
    w.delta_events({"reasoning_content": "plan"})
    w.delta_events({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"ci'}}]})
    done = [e["item"] for e in parse(w._finish_open("incomplete")) if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in w.items] == ["completed", "incomplete"] and done[0]["type"] == "function_call"
    # Not streamed: the same rule.
    full = writer(ChatOutput(reasoning=True))
    items = full.items_of({"reasoning_content": "plan", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_2", "function": {"name": "f", "arguments": '{"a'}}]}, "incomplete")
    assert [(i["type"], i["status"]) for i in items] == [("reasoning", "completed"), ("function_call", "completed"),
                                                         ("function_call", "incomplete")]


@pytest.mark.parametrize("text", ["<think>plan it</think>Hello there.", "<think>just thinking</think>", "",
                                  'Let me look.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'])
def test_streamed_and_full_responses_have_the_same_items_and_logprobs(tokenizer, text):
    """Reasoning then text, reasoning only (an empty message follows, as in a full response), nothing but EOS,
    text then a function call (the call's tokens come after the message item closed: the final Response lists
    them on the message, as a full one does)."""
    from rtp.outputs import RequestOutput
    from rtp.server.responses import ResponseBuilder

    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    lps = [{t: -0.5 - i} for i, t in enumerate(ids)]
    req = ResponsesRequest(input="x", include=["message.output_text.logprobs"])

    def writer_() -> ResponseWriter:
        return ResponseWriter(req, "resp_1", MODEL, 3, ChatOutput(reasoning=True, tool_mode="auto"), SamplingParams(),
                              ResponseBuilder("chat.completion", "r", MODEL, tokenizer, 3, 0))

    full = writer_()
    out = RequestOutput("r", None, [1], text=text, token_ids=ids, logprobs=lps, finish_reason="stop")
    items = full.items_of(full.output.message(text), "completed", out)
    streamed, events = writer_(), []
    for k in range(1, len(ids) + 1):  # one token a step; the EOS adds no text
        new = tokenizer.decode(ids[:k], skip_special_tokens=True)[len(tokenizer.decode(ids[: k - 1],
                                                                                         skip_special_tokens=True)):]
        step = RequestOutput("r", None, [1], token_ids=ids[:k], logprobs=lps[:k], new_text=new,
                             finish_reason="stop" if k == len(ids) else None)
        streamed.take_logprobs(step)
        events += parse(streamed.delta_events(streamed.output.delta(step.new_text, step.finished)))
        if step.finished:
            events += parse(streamed.closing(step, 0))

    def shape(items: list[dict]) -> list[tuple]:
        return [(i["type"], i["status"], json.dumps(i.get("content")), i.get("arguments")) for i in items]

    assert shape(streamed.items) == shape(items)
    assert [i["type"] for i in items] == ["message", "function_call"] if "tool_call" in text else True
    message = [i for i in items if i["type"] == "message"]
    assert len(message) == 1 and [e["logprob"] for e in message[0]["content"][0]["logprobs"]] == [
        -0.5 - i for i in range(len(ids))]
    final = events[-1]["response"]["output"]
    assert shape(final) == shape(items)  # the response.completed event's Response
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    listed = message[0]["content"][0]["logprobs"]
    assert deltas == listed[: len(deltas)] and (len(deltas) == len(listed)) == ("tool_call" not in text)
