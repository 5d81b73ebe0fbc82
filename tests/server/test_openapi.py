"""/openapi.json against the fake-engine app: the published contract is the validation that runs.

A client generated from the schema (datamodel-code-generator) round-trips
valid requests; the documented bounds are the enforced ones; real responses
and errors validate against the documented response schemas.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from datamodel_code_generator import DataModelType, InputFileType, generate
from datamodel_code_generator.format import Formatter
from fastapi.testclient import TestClient

from rtp.server.protocol import ChatCompletionRequest, CompletionRequest
from rtp.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from tests.server.test_api import MODEL, make_app, sse_events

# Every field each generation route accepts (the models' own fields, so a new one cannot be forgotten).
GENERATION_ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


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


@pytest.fixture(scope="module")
def schema(tokenizer) -> dict:
    app, _, _ = make_app(tokenizer)
    with TestClient(app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def request_schema(schema: dict, path: str) -> dict:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_generation_routes_document_every_accepted_field(schema):
    for path, model in GENERATION_ROUTES.items():
        body = request_schema(schema, path)
        assert set(body["properties"]) == set(model.model_fields), path
        assert len(body["properties"]) >= 24
    completion = request_schema(schema, "/v1/completions")
    chat = request_schema(schema, "/v1/chat/completions")
    assert completion["required"] == ["prompt"] and chat["required"] == ["messages"]
    props = completion["properties"]
    # The bounds the validation enforces, as published.
    assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert props["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert props["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0}  # 0 with echo: the prompt alone
    assert chat["properties"]["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert props["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert props["stream"] == {"type": "boolean", "default": False, "title": "Stream"}
    assert {"type": "string", "minLength": 1} in props["prompt"]["anyOf"]
    roles = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert roles == ["system", "developer", "user", "assistant", "tool"]


def test_every_route_documents_its_responses_and_errors(schema):
    ops = {(path, method): op for path, item in schema["paths"].items() for method, op in item.items()}
    assert set(ops) == {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                        ("/v1/models/{model_id}", "get"), ("/metrics", "get"), ("/health", "get"),
                        ("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"),
                        ("/v1/responses", "post")}
    for (path, _method), op in ops.items():
        assert "422" not in op["responses"], path  # validation errors are OpenAI-style 400s
        assert op["responses"]["200"]["content"], path
        for status, resp in op["responses"].items():
            if status not in ("200",) and path != "/health":
                assert resp["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    for path in GENERATION_ROUTES:
        responses = ops[(path, "post")]["responses"]
        assert {"400", "401", "404", "413", "500", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_a_generated_client_round_trips_valid_requests(schema, served, tmp_path):
    client, engine = served
    out = tmp_path / "rtp_client.py"
    generate(json.dumps(schema), input_file_type=InputFileType.OpenAPI, output=out,
             output_model_type=DataModelType.PydanticV2BaseModel, formatters=[Formatter.BUILTIN])
    spec = importlib.util.spec_from_file_location("rtp_client", out)
    gen = importlib.util.module_from_spec(spec)
    sys.modules["rtp_client"] = gen  # pydantic resolves the generated forward references through it
    try:
        spec.loader.exec_module(gen)
        req = gen.CompletionRequest(prompt="Once upon a time", max_tokens=3, temperature=0.5, top_p=0.9, seed=3,
                                    stop=["zz"], top_k=5, ignore_eos=True, model=MODEL)
        r = client.post("/v1/completions", json=req.model_dump(mode="json", exclude_none=True))
        assert r.status_code == 200, r.text
        params = engine.added[-1][1]
        assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.top_k) == (3, 0.5, 0.9, 3, 5)
        assert gen.CompletionResponse.model_validate(r.json()).usage.completion_tokens == 3

        chat = gen.ChatCompletionRequest(messages=[gen.ChatMessage(role="user", content="hi")],
                                         max_completion_tokens=2, logprobs=True, top_logprobs=1)
        r = client.post("/v1/chat/completions", json=chat.model_dump(mode="json", exclude_none=True))
        assert r.status_code == 200, r.text
        assert engine.added[-1][1].max_tokens == 2 and engine.added[-1][1].logprobs == 1
        body = gen.ChatCompletionResponse.model_validate(r.json())
        assert body.choices[0].message.role == "assistant" and len(body.choices[0].logprobs.content) == 2

        # The generated client refuses what the server refuses, with the same bounds.
        with pytest.raises(ValueError):
            gen.CompletionRequest(prompt="a", temperature=2.5)
        r = client.post("/v1/completions", json={"prompt": "a", "temperature": 2.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        gen.ErrorResponse.model_validate(r.json())
    finally:
        sys.modules.pop("rtp_client", None)


def test_real_responses_match_the_documented_models(served):
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "logprobs": 2})
    CompletionResponse.model_validate(r.json(), strict=True)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "logprobs": True, "top_logprobs": 2})
    ChatCompletionResponse.model_validate(r.json(), strict=True)
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        CompletionResponse.model_validate(e, strict=True)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                  "stream": True})
    for e in sse_events(r.text)[:-1]:
        ChatCompletionChunk.model_validate(e, strict=True)
    ModelList.model_validate(client.get("/v1/models").json(), strict=True)
    ModelCard.model_validate(client.get(f"/v1/models/{MODEL}").json(), strict=True)
    HealthResponse.model_validate(client.get("/health").json(), strict=True)
    for r in (client.get("/v1/models/nope"), client.post("/v1/completions", content=b"{")):
        assert r.status_code in (400, 404)
        ErrorResponse.model_validate(r.json(), strict=True)


# ---------------------------------------------------------------------------- fuzz findings (regressions)


@pytest.mark.parametrize("method,path,allow", [("TRACE", "/health", "GET"), ("DELETE", "/v1/completions", "POST"),
                                               ("PUT", "/v1/models", "GET")])
def test_an_undeclared_method_is_a_405_with_allow(served, method, path, allow):
    """Schemathesis (unsupported_method): the 405 dropped Starlette's Allow header (RFC 9110 requires it)."""
    client, _ = served
    r = client.request(method, path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    err = ErrorResponse.model_validate(r.json(), strict=True).error
    assert err.type == "invalid_request_error" and method in err.message and allow in err.message


def test_an_unknown_route_names_where_the_routes_are(served):
    client, _ = served
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "/openapi.json" in r.json()["error"]["message"]


UNSUPPORTED = [
    # (route, extra fields, the schema property and its published bound) - schemathesis (positive_data_acceptance)
    # sent best_of=2 and response_format {"type": ""}: the schema allowed them, the server refused them.
    ("/v1/completions", {"best_of": 2}, "best_of", ("maximum", 1)),
    ("/v1/completions", {"suffix": "x"}, "suffix", ("maxLength", 0)),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", ("maxItems", 0)),
]


@pytest.mark.parametrize("path,extra,field,bound", UNSUPPORTED)
def test_unsupported_values_are_outside_the_published_schema_and_get_a_400(schema, served, path, extra, field,
                                                                           bound):
    client, engine = served
    prop = request_schema(schema, path)["properties"][field]
    assert "not supported" in prop["description"]
    if bound is not None:
        key, value = bound
        assert prop["anyOf"][0][key] == value, prop
    else:
        fmt = schema["components"]["schemas"]["ResponseFormat"]["properties"]["type"]
        assert fmt.get("const", fmt.get("enum", [None])[0]) == "text", fmt
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    r = client.post(path, json={**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "is not supported: only" in err["message"], err
    assert engine.added == []


@pytest.mark.parametrize("echo", [0, 1, "false"])
def test_echo_must_be_a_boolean(served, echo):
    """Schemathesis (negative_data_rejection): echo=0 was accepted, since Literal[False] compares by == (0 == False)."""
    client, engine = served
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "echo": echo})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert engine.added == []
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "echo": False}).status_code == 200


@pytest.mark.parametrize(("field", "value"), [("n", 129), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                                              ("repetition_penalty", 0.0)])
def test_sampling_bounds_are_published_and_enforced(schema, served, field, value):
    """n and the penalties are supported now: their published bounds are the ones the server enforces."""
    client, engine = served
    prop = request_schema(schema, "/v1/completions")["properties"][field]
    bounds = prop["anyOf"][0]
    assert any(k in bounds for k in ("maximum", "minimum", "exclusiveMinimum")), prop
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert engine.added == []
