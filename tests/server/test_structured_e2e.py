"""Structured outputs, Qwen3 thinking and tool calls through launch/serve.py (TP=2, tiny random model),
driven by the official openai client.

One server for the module, started with ``--reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser hermes``. The random model writes junk, and never a ``<think>`` or ``<tool_call>``
of its own accord: the grammar is what makes the outputs valid, which is the point. Where a test needs
the model to think or to call a tool in Qwen3's own format, a ``guided_regex`` forces that shape (the
parsers then work on real generated text, streamed through the real detokenizer).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import kill, launch, wait_ready

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"active": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                           "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "minItems": 1, "maxItems": 2}},
            "required": ["active", "level", "codes"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "colour", "size", "tags", "owner"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_REGEX = r"<think>\n[a-z ]{3,20}\n</think>\n\n[a-z ]{3,20}"
# With --reasoning-parser a grammar applies after the model's think block (vLLM's rule), which the random model
# never closes: these requests close it in the prompt (Qwen3's enable_thinking false), so it applies from the start.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    config = tmp / "cpu.yaml"
    config.write_text(f"model: {default_model_dir()}\n"  # the random tiny model, whatever the default
                      "device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 32\nmax_num_batched_tokens: 2048\n"
                      "cpu_kv_cache_gib: 0.1\nenforce_eager: true\nlog_level: INFO\nserver:\n  shutdown_grace_s: 2\n")
    s = launch(tmp, "structured", config, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes")
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


@pytest.mark.timeout(300)
def test_json_schema_outputs_validate_for_20_seeds(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

    def one(seed: int):
        return client.chat.completions.create(model=model, messages=MSGS, response_format=fmt, seed=seed,
                                              extra_body=NO_THINK, temperature=1.0, max_tokens=400)

    with ThreadPoolExecutor(10) as pool:  # batched together in the engine, each with its own matcher
        responses = list(pool.map(one, range(20)))
    texts = []
    for r in responses:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice  # the grammar ended: EOS was the only token left
        obj = json.loads(choice.message.content)  # strict JSON: no raw control characters
        jsonschema.validate(obj, SCHEMA)
        texts.append(choice.message.content)
    assert len(set(texts)) >= 15  # seeded random sampling inside the grammar, not one fixed answer
    # json_object and the vLLM spellings on /v1/completions.
    # json_object has no size bound: the random model may run out of tokens inside it (finish "length",
    # as in vLLM); what it wrote is still the start of an object, and a finished one parses.
    for seed in range(4):
        r = client.chat.completions.create(model=model, messages=MSGS, response_format={"type": "json_object"},
                                           extra_body=NO_THINK, seed=seed, max_tokens=100)
        text = r.choices[0].message.content
        assert text.startswith("{") and "\n" not in text, text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=model, prompt="Pick:", max_tokens=20, seed=3,
                                  extra_body={"guided_choice": ["alpha beta", "gamma (delta)"]})
    assert r.choices[0].text in ("alpha beta", "gamma (delta)") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model, prompt="Code:", max_tokens=20, seed=4,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


@pytest.mark.timeout(120)
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "([a-"})
    assert e.value.body["param"] == "guided_regex" and "does not compile" in e.value.body["message"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema"


@pytest.mark.timeout(180)
def test_forced_tool_calls_parse(client, model):
    params = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, CLOCK], tool_choice=named,
                                       extra_body=NO_THINK, seed=5, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), params)
    # The same, streamed: the deltas of call 0 concatenate to the same arguments.
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, CLOCK],
                                                 extra_body=NO_THINK, tool_choice=named, seed=5, max_tokens=200,
                                                 stream=True))
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].function.name == "get_weather" and parts[0].id and all(p.index == 0 for p in parts)
    assert "".join(p.function.arguments or "" for p in parts) == calls[0].function.arguments
    # "required": one or more calls of the given tools, finish_reason "tool_calls".
    r = client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, CLOCK], tool_choice="required",
                                       extra_body=NO_THINK, seed=6, max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    for call in r.choices[0].message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # Streamed (the same seed): one whole call per delta entry, sent as its object closes; the same calls.
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER, CLOCK],
                                                 extra_body=NO_THINK, tool_choice="required", seed=6, max_tokens=300,
                                                 stream=True))
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(p.index, p.function.name, p.function.arguments) for p in parts] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(r.choices[0].message.tool_calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.timeout(180)
def test_required_calls_of_tools_with_definitions_and_parallel_tool_calls_false(client, model):
    """A tool whose parameters hold $defs (a nested pydantic model in the SDK) under "required": the grammar
    compiles and the arguments follow the referenced definition; parallel_tool_calls false: one call."""
    place = {"type": "object", "properties": {"city": {"enum": ["oslo", "rome"]}}, "required": ["city"],
             "additionalProperties": False}
    trip = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "additionalProperties": False, "$defs": {"Place": place}}}}
    counts = []
    for seed in range(3):
        for parallel in (True, False):
            r = client.chat.completions.create(model=model, messages=MSGS, tools=[trip, CLOCK], seed=seed,
                                               extra_body=NO_THINK, tool_choice="required",
                                               parallel_tool_calls=parallel, max_tokens=300)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
            for call in calls:
                tool = {"book": trip, "get_time": CLOCK}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            counts.append((parallel, len(calls)))
    assert all(n == 1 for parallel, n in counts if not parallel)
    # Schema keywords the grammar would not enforce, and structured_outputs keys rtp does not know: 400s.
    unique = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, response_format=unique)
    assert "'uniqueItems' at # is not supported" in e.value.body["message"]
    tag = {"structural_tag": json.dumps({"type": "structural_tag"})}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, extra_body={"structured_outputs": tag})
    assert e.value.body["param"] == "structured_outputs.structural_tag"
    # A boolean schema (true: any JSON value) is a schema too.
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=30, seed=1, extra_body=NO_THINK,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "any", "schema": True}})
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)


@pytest.mark.timeout(180)
def test_auto_tool_choice_parses_qwen3_tool_call_blocks(client, model, server):
    """The random model never writes <tool_call> by itself: a regex forces Qwen3's block, the parser reads it."""
    regex = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[a-z]{1,8}", "unit": "celsius"\}\}\n</tool_call>')
    extra = {"guided_regex": regex, **NO_THINK}
    r = client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER], seed=7, max_tokens=200,
                                       extra_body=extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "get_weather"
    args = json.loads(msg.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, tools=[WEATHER], seed=7,
                                                 max_tokens=200, stream=True, extra_body=extra))
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(parts) == 1 and json.loads(parts[0].function.arguments) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The call and its result go back in: role "tool" messages are accepted and rendered.
    history = MSGS + [msg.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    body = {"model": model, "messages": history, "tools": [WEATHER], "return_token_strs": False}
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": httpx.post(
        server.url + "/tokenize", json=body, timeout=30).json()["tokens"]}, timeout=30).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert f"<|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": " \
           f"{msg.tool_calls[0].function.arguments}}}\n</tool_call><|im_end|>" in prompt  # the call, rendered back
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.timeout(180)
def test_streamed_thinking_gives_reasoning_then_content(client, model):
    """Qwen3 opens <think> itself; the random model does not, so a regex forces a think block and an answer."""
    extra = {"guided_regex": THINK_REGEX, **NO_THINK}
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, seed=8, max_tokens=100, stream=True,
                                                 extra_body=extra))
    kinds = []
    reasoning = content = ""
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        r = getattr(delta, "reasoning_content", None)
        if r:
            kinds.append("r")
            reasoning += r
        if delta.content:
            kinds.append("c")
            content += delta.content
    assert kinds.count("r") >= 2 and kinds.count("c") >= 1, kinds  # reasoning arrives in several deltas
    assert kinds == sorted(kinds, key=lambda k: k == "c")  # all reasoning deltas before any content delta
    assert re.fullmatch("[a-z ]{3,20}", reasoning) and re.fullmatch("[a-z ]{3,20}", content)
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    r = client.chat.completions.create(model=model, messages=MSGS, seed=8, max_tokens=100, extra_body=extra)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (reasoning, content)  # the same split, not streamed


@pytest.mark.timeout(120)
def test_enable_thinking_false_renders_an_empty_think_block_and_no_reasoning(client, model, server):
    def rendered(**kwargs) -> str:
        body = {"model": model, "messages": MSGS, "return_token_strs": True, **kwargs}
        r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert r.json()["count"] == len(tokens) == len(r.json()["token_strs"])
        text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
        return text

    on, off = rendered(), rendered(chat_template_kwargs={"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert off == on + "<think>\n\n</think>\n\n"  # Qwen3's "no thinking" marker: an empty, closed block
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=16, seed=9,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None and r.usage.prompt_tokens == len(
        httpx.post(server.url + "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {
            "enable_thinking": False}}, timeout=30).json()["tokens"])
    version = httpx.get(server.url + "/version", timeout=30)
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
