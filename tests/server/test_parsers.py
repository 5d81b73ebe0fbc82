"""The reasoning and tool-call parsers, and the assistant message built from them (no server).

Expected splits are written by hand; the streaming parsers must agree with the non-streaming ones
however the text is cut into deltas.
"""

from __future__ import annotations

import json
import random

import pytest

from rtp.server.chat_output import ChatOutput
from rtp.server.reasoning import ReasoningStream, split_reasoning, think_state
from rtp.server.tools import RequiredCallStream, ToolCallStream, parse_required, parse_tool_calls, required_schema

REASONING_CASES = [
    ("<think>\nplan it\n</think>\n\nthe answer", "plan it", "the answer"),
    ("no think block at all", None, "no think block at all"),
    ("<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("  <think>a</think>b", "a", "b"),
    ("<think>\n\n</think>\n\nanswer <think> later", None, "answer <think> later"),  # enable_thinking=false shape
    ("<thin", None, "<thin"),
    ("\n\nhi", None, "\n\nhi"),
    ("x</think>y", None, "x</think>y"),  # Qwen3 opens the block itself: no <think>, no reasoning
    ("", None, None),
]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(rng.randint(0, 6), len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_split_and_its_stream_agree(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    rng = random.Random(text)
    for _ in range(60):
        pieces = random_pieces(text, rng) or [""]
        stream, got_r, got_c = ReasoningStream(), "", ""
        for i, piece in enumerate(pieces):
            d = stream.feed(piece, final=i == len(pieces) - 1)
            got_r, got_c = got_r + d.reasoning, got_c + d.content
        assert (got_r or None, got_c or None) == (reasoning, content), pieces


@pytest.mark.parametrize("text,reasoning,content", [("\nplan\n</think>\n\nanswer", "plan", "answer"),
                                                    ("cut off", "cut off", None), ("</think>x", None, "x")])
def test_an_output_that_starts_inside_a_think_block_the_prompt_opened(text, reasoning, content):
    """A template that opens the block for the model (Qwen3's thinking-only models): the output is reasoning until
    its </think>; split whole and streamed alike."""
    assert split_reasoning(text, opened=True) == (reasoning, content)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(opened=True)
        a, b = stream.feed(text[:cut]), stream.feed(text[cut:], final=True)
        assert ((a.reasoning + b.reasoning) or None, (a.content + b.content) or None) == (reasoning, content), cut
    assert think_state("<|im_start|>assistant\n<think>\n") == "open"
    assert think_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert think_state("<think>a</think>b<|im_start|>user\nq<|im_start|>assistant\n") == "none"  # an earlier turn's


def test_reasoning_stream_holds_back_a_split_tag():
    s = ReasoningStream()
    d = s.feed("<thi")
    assert (d.reasoning, d.content) == ("", "")  # might still become <think>
    d = s.feed("nk>x")
    assert (d.reasoning, d.content) == ("x", "")
    s = ReasoningStream()
    assert s.feed("<think>abc</th").reasoning == "abc"
    d = s.feed("ink>\n\nrest")
    assert (d.reasoning, d.content) == ("", "rest")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL + "\n" + CALL2, "Let me check.\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("no calls here", "no calls here", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # cut before </tool_call>
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # not a call: plain content
    # A valid call and an invalid block: the call is kept (a stream has sent it), the block is text.
    (CALL + "\n<tool_call>{oops</tool_call>", "<tool_call>{oops</tool_call>", [("get_weather", {"city": "Paris"})]),
    (CALL + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris"})]),
    # Cut inside a second call's JSON: the block is text (without the newline between the blocks).
    ("Sure. " + CALL + '\n<tool_call>\n{"name": "get_ti', 'Sure. <tool_call>\n{"name": "get_ti',
     [("get_weather", {"city": "Paris"})]),
])
def test_tool_call_parsing_and_its_stream_agree(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    rng = random.Random(text)
    for _ in range(60):
        pieces = random_pieces(text, rng) or [""]
        stream, streamed_content, streamed = ToolCallStream(), "", []
        for i, piece in enumerate(pieces):
            c, found = stream.feed(piece, final=i == len(pieces) - 1)
            streamed_content += c
            streamed += found
        assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls, pieces
        if calls:
            assert streamed_content == (content or ""), pieces


def test_required_schema_and_its_parser():
    import jsonschema

    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools)
    good = [{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {"x": "no"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = parse_required(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert content is None and parse_required("[{") == ("[{", [])


def test_required_schema_moves_each_tools_definitions_to_its_root_and_can_allow_one_call():
    import jsonschema

    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "$defs": {"Place": place}}}},
             {"type": "function", "function": {"name": "b", "parameters": {
                 "type": "object", "properties": {"at": {"$ref": "#/definitions/Place"}},
                 "definitions": {"Place": place}}}}]
    schema = required_schema(tools)
    assert schema["$defs"] == schema["definitions"] == {"Place": place}
    calls = [{"name": "a", "parameters": {"to": {"city": "Oslo"}}}, {"name": "b", "parameters": {"at": {"city": "x"}}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):  # the ref resolves: a Place needs its city
        jsonschema.validate([{"name": "a", "parameters": {"to": {}}}], schema)
    one = required_schema(tools, parallel=False)
    jsonschema.validate(calls[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, one)
    clash = {"type": "function", "function": {"name": "c", "parameters": {"$defs": {"Place": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="Place"):
        required_schema([*tools, clash])
    bad = {"type": "function", "function": {"name": "d", "parameters": {"$defs": [1]}}}
    with pytest.raises(ValueError, match=r"parameters\.\$defs must be an object"):  # was an AttributeError: a 500
        required_schema([bad])


def test_one_call_keeps_the_first_auto_call_and_named_choices_get_their_own_ids():
    import copy

    text = "".join(f'<tool_call>\n{{"name": "f", "arguments": {{"i": {i}}}}}\n</tool_call>' for i in range(3))
    whole = ChatOutput(tool_mode="auto", one_call=True).message(text)
    assert [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == [{"i": 0}]
    out, streamed = ChatOutput(tool_mode="auto", one_call=True), []
    for i in range(0, len(text), 7):
        streamed += out.delta(text[i:i + 7], final=i + 7 >= len(text)).get("tool_calls", [])
    assert [(c["index"], c["function"]["arguments"]) for c in streamed] == [(0, whole["tool_calls"][0]["function"]
                                                                              ["arguments"])]
    assert len(ChatOutput(tool_mode="auto").message(text)["tool_calls"]) == 3
    # n > 1: each choice's ChatOutput is a copy of one made before any text; each call has its own id.
    template = ChatOutput(tool_mode="named", tool_name="f")
    ids = {copy.deepcopy(template).delta('{"i"', final=False)["tool_calls"][0]["id"] for _ in range(3)}
    assert len(ids) == 3


def test_required_calls_stream_as_each_object_closes_and_equal_the_whole_parse():
    calls = [{"name": "a", "parameters": {"s": "} ] { [ \\\" \u00e9", "n": [1, {"k": []}]}},
             {"name": "b", "parameters": {}}]
    text = json.dumps(calls, ensure_ascii=False)
    first_end = text.index(', {"name": "b"')  # the first object closes just before
    for cut in (len(text), len(text) - 5):  # whole, and cut off inside the second call
        whole = ChatOutput(tool_mode="required").message(text[:cut])
        out = ChatOutput(tool_mode="required")
        deltas = [(i, out.delta(ch, i == cut - 1)) for i, ch in enumerate(text[:cut])]
        sent = [(i, c) for i, d in deltas for c in d.get("tool_calls", [])]
        assert sent[0][0] == first_end - 1  # the first call goes out with the character that closes it
        assert [c["index"] for _, c in sent] == list(range(len(sent)))
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for _, c in sent]
        assert got == [(c["name"], c["parameters"]) for c in calls][: len(sent)]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
            (c["function"]["name"], c["function"]["arguments"]) for _, c in sent]
        content = "".join(d.get("content", "") for _, d in deltas)
        assert content == (whole["content"] or "")
        assert (len(sent), content) == ((2, "") if cut == len(text) else (1, text[first_end + 2 : cut]))
        assert out.finish_reason("stop") == "tool_calls"
    # No call closed: the whole text is the content, as before.
    assert ChatOutput(tool_mode="required").message('[{"name": "a", "par') == {
        "role": "assistant", "content": '[{"name": "a", "par'}


def test_a_long_required_stream_keeps_only_the_object_being_read():
    calls = [{"name": "a", "parameters": {"i": i, "s": "x" * (i % 7)}} for i in range(300)]
    text = json.dumps(calls)
    stream, got, longest = RequiredCallStream(), [], 0
    for ch in text:
        got += stream.feed(ch)[1]
        longest = max(longest, len(stream._text))
    assert [json.loads(c.arguments) for c in got] == [c["parameters"] for c in calls]
    assert longest <= max(len(json.dumps(c)) for c in calls) + 2  # not the whole text (the cost per delta)


def test_chat_output_messages_and_deltas():
    text = "<think>\nhmm\n</think>\n\n" + CALL
    msg = ChatOutput(reasoning=True, tool_mode="auto").message(text)
    assert msg["reasoning"] == msg["reasoning_content"] == "hmm" and msg["content"] is None  # vLLM's name, its old
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    out = ChatOutput(reasoning=True, tool_mode="auto")
    deltas = [out.delta(text[:9], False), out.delta(text[9:40], False), out.delta(text[40:], True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert [d.get("reasoning") for d in deltas] == [d.get("reasoning_content") for d in deltas]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0] and calls[0]["function"]["name"] == "get_weather"
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    # A named choice: the whole output is the arguments; the first delta names the function.
    named = ChatOutput(reasoning=True, tool_mode="named", tool_name="get_weather")
    first, second = named.delta('{"city": ', False), named.delta('"Rome"}', True)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": '"Rome"}'}}]
    assert named.finish_reason("stop") == "stop"  # as OpenAI answers a forced function
    # No parser: the text is the content, untouched.
    assert ChatOutput().message("<think>x</think>y") == {"role": "assistant", "content": "<think>x</think>y"}
