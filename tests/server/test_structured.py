"""Grammar compilation and constraints (rtp.structured), the Qwen3-style chat template of the tiny model,
and the request plumbing of structured outputs, tools, chat_template_kwargs and /tokenize on the
fake-engine app. End-to-end generation is in test_structured_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rtp.config import load_config
from rtp.server.api import build_app
from rtp.server.async_engine import AsyncEngine
from rtp.structured import (
    GrammarCompileError,
    GrammarCompiler,
    GrammarSpec,
    json_safe_tokens,
    pack_bitmask,
    unenforced_keyword,
)
from rtp.testing import CHAT_TEMPLATE, MARKUP_TOKENS, SPECIAL_TOKENS, default_model_dir
from tests.server.test_api import FakeEngine, fake_model_info

pytest.importorskip("xgrammar")

VOCAB = 512  # the tiny model's padded vocabulary (the tokenizer has fewer tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.convert_tokens_to_ids("<|im_end|>")])


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Reference unpacking, one bit at a time."""
    return torch.tensor([bool((int(words[i // 32]) >> (i % 32)) & 1) for i in range(vocab)])


def run_grammar(compiler, spec: GrammarSpec, tokenizer, seed: int, max_steps: int = 300) -> tuple[str, bool]:
    """Random logits through the constraint: (text, finished by the grammar)."""
    make = compiler.constraint_factory(compiler.compile(spec), spec)
    c, gen, out = make(), torch.Generator().manual_seed(seed), []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for _ in range(max_steps):
        logits = torch.randn(VOCAB, generator=gen) * 3
        words = c.allowed_tokens(VOCAB)
        if words is not None:
            allowed = unpack(words, VOCAB)
            assert not allowed[len(tokenizer):].any()  # padding ids past the tokenizer are never allowed
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        c.accept(token)
        if c.is_terminated():
            assert token == eos
            return tokenizer.decode(out), True
        out.append(token)
    return tokenizer.decode(out), False


def test_pack_bitmask_matches_a_bit_by_bit_reference():
    rng = random.Random(0)
    for n in (1, 31, 32, 33, 95, 512):
        mask = torch.tensor([rng.random() < 0.5 for _ in range(n)])
        mask[-1] = True  # the sign bit of a full word
        assert torch.equal(unpack(pack_bitmask(mask), n), mask)


def test_json_schema_outputs_validate_and_control_characters_are_excluded(compiler, tokenizer):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["a", "b c"]},
        "items": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 50}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}},
        "required": ["name", "kind", "items", "inner"], "additionalProperties": False}
    spec = GrammarSpec.json_schema(schema, "guided_json")
    for seed in range(12):
        text, done = run_grammar(compiler, spec, tokenizer, seed)
        assert done, text
        obj = json.loads(text)  # strict: a raw control character in a string would fail here
        jsonschema.validate(obj, schema)
        assert list(obj) == ["name", "kind", "items", "inner"]  # the schema's property order
    safe = json_safe_tokens(tokenizer, VOCAB)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and not safe[newline[0]] and safe[tokenizer.encode("a", add_special_tokens=False)[0]]


@pytest.mark.parametrize("spec,check", [
    (GrammarSpec.choice(["yes", "no (1+1)?"], "guided_choice"), lambda t: t in ("yes", "no (1+1)?")),
    (GrammarSpec("regex", "[a-c]{2}-[0-9]{1,3}", "guided_regex"),
     lambda t: __import__("re").fullmatch("[a-c]{2}-[0-9]{1,3}", t)),
    (GrammarSpec("grammar", 'root ::= "x" ("y" | "zz") "!"', "guided_grammar"), lambda t: t in ("xy!", "xzz!")),
])
def test_regex_choice_and_ebnf(compiler, tokenizer, spec, check):
    for seed in range(4):
        text, done = run_grammar(compiler, spec, tokenizer, seed)
        assert done and check(text), text


def test_compiled_grammars_are_cached_and_errors_name_the_field(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], cache_size=2)
    a = GrammarSpec.json_schema({"type": "object"}, "guided_json")
    first = c.compile(a)
    assert c.compile(GrammarSpec.json_schema('{"type": "object"}', "response_format")) is first
    assert (c.hits, c.misses) == (1, 1)
    c.compile(GrammarSpec("regex", "a", "guided_regex"))
    c.compile(GrammarSpec("regex", "b", "guided_regex"))  # evicts the least recently used: the schema
    assert c.compile(a) is not first and c.misses == 4
    for spec in (GrammarSpec("regex", "([a-", "guided_regex"),
                 GrammarSpec("grammar", "root ::= nope", "guided_grammar"),
                 GrammarSpec.json_schema({"type": "no-such-type"}, "response_format.json_schema.schema")):
        with pytest.raises(GrammarCompileError) as e:
            c.compile(spec)
        message = str(e.value)
        assert e.value.field == spec.field and message.startswith(spec.field + ": the grammar does not compile: ")
        assert ".cc:" not in message  # xgrammar's C++ log prefix is stripped
    with pytest.raises(GrammarCompileError):
        GrammarSpec.json_schema("{not json", "guided_json")


def test_a_grammar_after_thinking_lets_the_think_block_through_and_rolls_back_across_it(compiler, tokenizer):
    """GrammarSpec.after (a reasoning parser's ``</think>``): no mask until that token, the grammar after it; a
    verification step's rollback that undoes the ``</think>`` makes the output free again."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    spec = dataclasses.replace(GrammarSpec("regex", "ab", "guided_regex"), after=think_end)
    c = compiler.constraint_factory(compiler.compile(spec), spec)()
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    thinking = tokenizer.encode("<think>\nhmm", add_special_tokens=False)
    for t in thinking:
        assert c.allowed_tokens(VOCAB) is None and not c.is_terminated()
        c.accept(t)
    c.accept(think_end)
    assert unpack(c.allowed_tokens(VOCAB), VOCAB).nonzero().flatten().tolist() == [a]  # the grammar now
    c.accept(a)
    c.rollback(2)  # "a" and "</think>": free output again
    assert c.allowed_tokens(VOCAB) is None
    c.accept(think_end)
    c.accept(a)
    c.accept(b)
    c.rollback(1)
    assert unpack(c.allowed_tokens(VOCAB), VOCAB).nonzero().flatten().tolist() == [b] and c.rejected == 0
    c.accept(b)
    assert not c.is_terminated()  # the regex is complete: only the stop token is left
    c.accept(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert c.is_terminated()


# (schema, an instance that breaks it): xgrammar 0.2 compiles each and then accepts the instance.
UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [1, 2]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, {"a": 1}),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ({"type": "number", "multipleOf": 0.5}, 0.3),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, 9),
    ({"type": "string", "pattern": "a+", "minLength": 3}, "a"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",  # draft 7's dependentRequired
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependencies": {"a": ["b"]}}, {"a": 1}),
]


@pytest.mark.parametrize("schema,instance", UNENFORCED)
def test_schema_keywords_the_grammar_would_ignore_are_refused(tokenizer, schema, instance):
    import xgrammar as xgr

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema)
    # Why they are refused: compiled as they are, the grammar accepts the instance that breaks them.
    info = xgr.TokenizerInfo(["</s>"] + [chr(i) for i in range(32, 127)], stop_token_ids=[0])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema),
                                                                                any_whitespace=False))
    assert matcher.accept_string(json.dumps(instance)) and matcher.accept_token(0)
    nested = {"type": "object", "properties": {"uniqueItems": {"$ref": "#/$defs/x"}}, "$defs": {"x": schema}}
    for where, wrapped in (("#", schema), ("#/$defs/x", nested)):
        assert unenforced_keyword(wrapped)[0] == where
        with pytest.raises(GrammarCompileError) as e:
            GrammarSpec.json_schema(wrapped, "response_format.json_schema.schema")
        assert f"at {where} is not supported" in str(e.value)
    # Data that merely looks like those keywords (a property's name, an enum value) is not refused.
    assert unenforced_keyword({"type": "object", "properties": {"not": {"enum": [{"uniqueItems": True}]}},
                               "allOf": [{"type": "object"}]}) is None
    assert unenforced_keyword({"type": "integer", "multipleOf": 3}) is None  # integers: enforced
    assert unenforced_keyword({"type": ["integer", "null"], "multipleOf": 3}) is None
    deep: dict = {"type": "integer"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarCompileError, match="nests too deeply"):  # a RecursionError: a 500
        GrammarSpec.json_schema(deep, "guided_json")


# ---- the chat template of the tiny model ----


def test_template_tokens_and_qwen3_structure(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for tok in MARKUP_TOKENS:  # one added token each, kept when special tokens are skipped
        ids = tokenizer.encode(tok, add_special_tokens=False)
        assert len(ids) == 1 and tok not in tokenizer.all_special_tokens
        assert tokenizer.decode(ids, skip_special_tokens=True) == tok
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == tools
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>' in text
    # Consecutive tool results: one user turn.
    assert "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>" \
           "<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Reasoning of an earlier turn is dropped; the final assistant turn after the last query keeps it.
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nx"},
               {"role": "user", "content": "b"}, {"role": "assistant", "content": "y", "reasoning_content": "r2"}]
    text = tokenizer.apply_chat_template(history, tokenize=False)
    assert "r1" not in text and "<|im_start|>assistant\nx<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nr2\n</think>\n\ny<|im_end|>" in text


# ---- request plumbing (fake engine) ----


@pytest.fixture
def served(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.max_model_len = 1024  # room for a tools system prompt
    config = load_config(None, server={"max_tokens_limit": 40, "default_max_tokens": 12})
    app = build_app(AsyncEngine(engine), config, fake_model_info(engine))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine


MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}


def test_an_earlier_turns_reasoning_under_either_name_reaches_the_template(served):
    """vLLM's clients send an assistant turn's think block back as ``reasoning`` (its newer name) or
    ``reasoning_content``: the same prompt either way, with the block in it."""
    client, engine = served
    prompts = []
    for key in ("reasoning", "reasoning_content"):
        turns = [*MSGS, {"role": "assistant", "content": "y", key: "r2"}]
        assert client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2}).status_code == 200
        prompts.append(engine.added[-1][0])
    assert prompts[0] == prompts[1] and "r2" in engine.tokenizer.decode(prompts[0])


def test_constraints_reach_the_sampling_params(served, tokenizer):
    client, engine = served
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}
    for body in ({"messages": MSGS, "response_format": fmt}, {"messages": MSGS, "guided_choice": ["a", "b"]},
                 {"messages": MSGS, "structured_outputs": {"json_object": True}},
                 {"messages": MSGS, "tools": [TOOL], "tool_choice": "required"},
                 {"messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}):
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text
        constraint = engine.added[-1][1].constraint
        assert callable(constraint) and constraint().allowed_tokens(VOCAB) is not None
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "[0-9]+"})
    assert r.status_code == 200 and callable(engine.added[-1][1].constraint)
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert engine.added[-1][1].constraint is None
    # Named choice: the fake's text becomes the arguments of the named function.
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "tools": [TOOL],
                                                  "tool_choice": {"type": "function", "function": {"name": "f"}}})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "f" and call["id"].startswith("call_")


def test_with_a_reasoning_parser_grammars_apply_after_the_think_block(tokenizer):
    """As vLLM: a thinking model thinks, then answers in the grammar. The constraint lets everything through until
    ``</think>``, unless the prompt closed the think block itself (enable_thinking false); a forced tool call's
    arguments are read from the answer after the block, its reasoning reported beside it."""
    engine = FakeEngine(tokenizer)
    engine.max_model_len = 1024
    answer = '{"x": 1}'
    engine.pattern = tokenizer.encode(f"<think>\nwhich x\n</think>\n\n{answer}", add_special_tokens=False)
    config = load_config(None, server={"reasoning_parser": "qwen3"})
    with TestClient(build_app(AsyncEngine(engine), config, fake_model_info(engine))) as client:
        named = {"type": "function", "function": {"name": "f"}}
        body = {"messages": MSGS, "tools": [TOOL], "tool_choice": named, "max_tokens": len(engine.pattern)}
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**body, "stream": stream})
            constraint = engine.added[-1][1].constraint()
            assert constraint.allowed_tokens(VOCAB) is None  # thinking: free
            constraint.accept(tokenizer.convert_tokens_to_ids("</think>"))
            assert constraint.allowed_tokens(VOCAB) is not None  # then the function's parameters
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
                reasoning = "".join(d.get("reasoning") or "" for d in deltas)
                args = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls", []))
            else:
                msg = r.json()["choices"][0]["message"]
                reasoning, args = msg["reasoning"], msg["tool_calls"][0]["function"]["arguments"]
            assert reasoning.strip() == "which x" and json.loads(args) == {"x": 1}, r.text
            if stream:  # the call opens with its arguments, after the reasoning
                kinds = ["r" if d.get("reasoning") else "t" for d in deltas
                         if d.get("reasoning") or d.get("tool_calls")]
                assert kinds == sorted(kinds) and "r" in kinds, kinds
        # The Responses API streams the same as a reasoning item, then the function call (a KeyError before).
        fn = {"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]}
        r = client.post("/v1/responses", json={"input": "hi", "tools": [fn], "stream": True,
                                               "tool_choice": {"type": "function", "name": "f"},
                                               "max_output_tokens": len(engine.pattern)})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert events[-1]["type"] == "response.incomplete", events[-1]  # the fake ends at max_output_tokens
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "function_call"]
        assert len(done) == 1 and json.loads(done[0]["arguments"]) == {"x": 1}
        r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert engine.added[-1][1].constraint().allowed_tokens(VOCAB) is not None  # from the first token
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "[0-9]+"})
        assert engine.added[-1][1].constraint().allowed_tokens(VOCAB) is not None  # no chat, no think block


def test_tools_and_template_kwargs_reach_the_prompt(served, tokenizer):
    client, engine = served
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": [TOOL], "tool_choice": "none",
                                                  "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    want = tokenizer.apply_chat_template(MSGS, tools=[TOOL], add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    assert engine.added[-1][0] == tokenizer.encode(want, add_special_tokens=False)
    # "auto" (the default with tools) needs the server flags, as in vLLM.
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": [TOOL], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": [TOOL], "max_tokens": 2,
                                                  "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"


def test_detokenize_takes_the_models_padded_vocabulary(tokenizer):
    # ids past the tokenizer in the model's padded vocabulary (which prompts may hold, and a model may generate)
    # have no text; ids past the vocabulary are a 400
    engine = FakeEngine(tokenizer)
    info = dataclasses.replace(fake_model_info(engine), vocab_size=VOCAB)
    assert len(tokenizer) < VOCAB
    with TestClient(build_app(AsyncEngine(engine), load_config(None), info)) as client:
        ids = tokenizer.encode("Hello world")
        assert client.post("/detokenize", json={"tokens": [*ids, VOCAB - 1]}).json() == {"prompt": "Hello world"}
        r = client.post("/detokenize", json={"tokens": [*ids, VOCAB]})
        assert r.status_code == 400 and "vocabulary has 512 tokens" in r.json()["error"]["message"]


def test_tokenize_detokenize_version(served, tokenizer):
    client, _ = served
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["token_strs"] == tokenizer.convert_ids_to_tokens(
        body["tokens"]) and body["max_model_len"] > 0
    r = client.post("/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}})
    want = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert r.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False) and r.json()["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    for bad, param in (({"tokens": [10**6]}, "tokens"), ({"tokens": [-1]}, "tokens.0")):
        r = client.post("/detokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = client.post("/tokenize", json={"prompt": "a", "messages": MSGS})
    assert r.status_code == 400
    assert client.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 404
    assert isinstance(client.get("/version").json()["version"], str)
