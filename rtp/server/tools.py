"""Tool calling: Qwen3's ``<tool_call>`` output parsed into OpenAI ``tool_calls``, and the grammars of
``tool_choice`` "required" and a named function.

Qwen3 (like Hermes) answers a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call, after any text. ``--enable-auto-tool-choice --tool-call-parser hermes`` (vLLM's
flags; ``qwen3`` is accepted as the same parser) turns on :func:`parse_tool_calls` for
``tool_choice: "auto"``. A forced choice does not depend on the model following that format: as in
vLLM, the output is constrained by a JSON schema, the function's parameters for a named choice and
a non-empty list of ``{"name", "parameters"}`` for "required" (:func:`required_schema`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from rtp.server.reasoning import partial_suffix

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

TOOL_CALL_PARSERS = ("hermes", "qwen3")

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (with ``index`` in a stream delta)."""
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def _arguments_text(value: Any) -> str:  # noqa: ANN401 - any JSON value
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_from_json(text: str, args_key: str = "arguments") -> ToolCall | None:
    """A call from ``{"name": ..., "arguments": ...}`` text; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters" if args_key == "arguments" else "arguments", {}))
    return ToolCall(obj["name"], _arguments_text(args))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output: the same as :class:`ToolCallStream` gives in pieces.

    Content is the text before the first ``<tool_call>``, then every block that is not valid
    call JSON (passed on as text: a stream cannot take back the calls it already sent), then
    any text after the last block.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text or None, []
    content, calls, end = text[:start], [], start
    for m in _BLOCK.finditer(text, start):
        call = call_from_json((m.group(1) if m.group(1) is not None else m.group(2)).strip())
        if call is None:
            content += m.group(0)
        else:
            calls.append(call)
        end = m.end()
    if text[end:].strip():
        content += text[end:]
    return (content if content.strip() else None), calls


def parse_required(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished ``tool_choice: "required"`` output (a JSON list, see
    :func:`required_schema`): the same as :class:`RequiredCallStream` gives in pieces."""
    content, calls = RequiredCallStream().feed(text, final=True)
    return content or None, calls


class RequiredCallStream:
    """Incremental :func:`parse_required`: one complete call as soon as its object in the list closes.

    The text is scanned once, character by character, for the list's top-level objects (strings and
    nesting tracked). An object that is not a call is skipped. At the end, an output in which no call
    closed is passed on whole as content, and one cut off inside a later object passes that object's
    text on as content (the calls before it are sent already).
    """

    def __init__(self) -> None:
        self._text = ""
        self._depth = 0  # open brackets and braces, the list's own included
        self._in_string = self._escape = False
        self._start = -1  # where the top-level object being read began
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) for ``delta``: content only at the end (see the class docstring)."""
        scanned, text = len(self._text), self._text + delta
        calls: list[ToolCall] = []
        for i in range(scanned, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = i
            elif c in "]}":
                if self._depth == 2 and self._start >= 0:
                    call = call_from_json(text[self._start : i + 1], "parameters")
                    if call is not None:
                        calls.append(call)
                    self._start = -1
                self._depth -= 1
        self.num_calls += len(calls)
        if self.num_calls:  # only the object being read may still be needed (as content, if it never closes)
            text, self._start = (text[self._start :], 0) if self._start >= 0 else ("", -1)
        self._text = text
        return (text if final else ""), calls


class ToolCallStream:
    """Incremental :func:`parse_tool_calls`: content deltas until the first ``<tool_call>``, then one
    complete call per closed block (OpenAI clients concatenate the deltas of a call by index)."""

    def __init__(self) -> None:
        self._held = ""
        self.in_calls = False
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        text = self._held + delta
        self._held = ""
        content, calls = "", []
        if not self.in_calls:
            start = text.find(TOOL_CALL_START)
            if start < 0:
                keep = 0 if final else partial_suffix(text, TOOL_CALL_START)
                self._held = text[len(text) - keep:]
                return text[: len(text) - keep], []
            content, text, self.in_calls = text[:start], text[start:], True
        while True:
            start = text.find(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, start + 1) if start >= 0 else -1
            if start < 0 or end < 0:
                break
            block, text = text[start + len(TOOL_CALL_START):end], text[end + len(TOOL_CALL_END):]
            call = call_from_json(block.strip())
            if call is None:
                content += TOOL_CALL_START + block + TOOL_CALL_END  # not a call: pass it on as text
            else:
                calls.append(call)
        if final:  # an unclosed last block (a call, else text from its tag on), or text after the last block
            start = text.find(TOOL_CALL_START)
            call = call_from_json(text[start + len(TOOL_CALL_START):].strip()) if start >= 0 else None
            if call is not None:
                calls.append(call)
            elif start >= 0:
                content += text[start:]
            elif text.strip():
                content += text
        else:
            self._held = text
        self.num_calls += len(calls)
        return content, calls


# ---- tool_choice grammars ----


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool."""
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else {}


def parameters_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


_DEFS = ("$defs", "definitions")  # where a schema's "#/$defs/..." (or draft-07 "#/definitions/...") refs point


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """JSON schema of a ``tool_choice: "required"`` answer: a non-empty list of calls of the given tools (one
    call at most when ``parallel`` is False). Each tool's definitions move to the list's root, where its refs
    now point; ValueError when two tools define one name differently."""
    variants: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEFS}
    for t in tools:
        params = dict(parameters_schema(function_of(t)))
        for key in _DEFS:
            found = params.pop(key, None) or {}
            if not isinstance(found, dict):
                raise ValueError(f"tool {function_of(t).get('name')!r}: parameters.{key} must be an object")
            for name, schema in found.items():
                if defs[key].setdefault(name, schema) != schema:
                    raise ValueError(f"tools define {key}/{name} differently: rename one of them")
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [function_of(t).get("name")]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": variants}}
    return {**schema, **{key: value for key, value in defs.items() if value}}
