"""The assistant message of a chat response: the generated text split into reasoning, content and tool calls.

One :class:`ChatOutput` per request. ``reasoning`` turns on the ``<think>`` split
(rtp.server.reasoning); ``tool_mode`` says how tool calls are read:

- "none": no parsing, the text is content;
- "auto": Qwen3's ``<tool_call>`` blocks (rtp.server.tools.parse_tool_calls);
- "required": the output is a JSON list of ``{"name", "parameters"}`` (forced by a grammar), streamed one
  call per closed object;
- "named": the output is the arguments of ``tool_name`` (forced by a grammar).

A response with calls in "auto" or "required" mode ends with ``finish_reason: "tool_calls"``
(OpenAI's; a named choice keeps "stop", as OpenAI does). With ``parallel_tool_calls: false`` (``one_call``) an
"auto" output's calls after the first are dropped (as vLLM; "required" gets a grammar of one call).
"""

from __future__ import annotations

from typing import Any, Literal

from rtp.server.reasoning import ReasoningStream, split_reasoning
from rtp.server.tools import RequiredCallStream, ToolCall, ToolCallStream, parse_required, parse_tool_calls

ToolMode = Literal["none", "auto", "required", "named"]


class ChatOutput:
    def __init__(self, reasoning: bool = False, tool_mode: ToolMode = "none", tool_name: str | None = None,
                 one_call: bool = False, thinks_first: bool = False, opened: bool = False) -> None:
        # A forced tool choice's grammar applies after the think block (``thinks_first``: GrammarSpec.after), or
        # from the first token when the prompt closed the block itself: then there is no think block to split.
        # ``opened``: the prompt opened the block, the output starts inside it.
        self.reasoning = reasoning and (tool_mode not in ("required", "named") or thinks_first)
        self.tool_mode, self.tool_name = tool_mode, tool_name
        self.max_calls = 1 if one_call else None
        self.has_calls = False
        self._opened = opened
        self._reasoning_stream = ReasoningStream(opened)
        self._tool_stream = ToolCallStream()
        self._required = RequiredCallStream()

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.has_calls and self.tool_mode != "named" else reason

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` of a finished, non-streamed response."""
        msg: dict[str, Any] = {"role": "assistant"}
        reasoning, content = split_reasoning(text, self._opened) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.tool_mode == "auto" and content is not None:
            content, calls = parse_tool_calls(content)
            calls = calls[:self.max_calls]
        elif self.tool_mode == "required":
            content, calls = parse_required(content or "")
        elif self.tool_mode == "named":
            calls, content = [ToolCall(self.tool_name or "", content or "")], None
        msg["content"] = content if content is not None or calls else ""  # null only beside tool calls
        if self.reasoning:  # vLLM's name now, and its earlier one (DeepSeek's), for clients of either
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [c.openai() for c in calls]
            self.has_calls = True
        return msg

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        """The ``delta`` of a stream chunk for the newly generated text ({} when there is nothing to send yet)."""
        out: dict[str, Any] = {}
        content = new_text
        if self.reasoning:
            d = self._reasoning_stream.feed(new_text, final)
            if d.reasoning:
                out["reasoning"] = out["reasoning_content"] = d.reasoning
            content = d.content
        if self.tool_mode == "named":
            if not content and not final:  # the call opens with its first argument text, after any reasoning
                return out
            if not self.has_calls:  # the first chunk names the function (each choice's call its own id)
                self.has_calls = True
                out["tool_calls"] = [ToolCall(self.tool_name or "", content).openai(0)]
            elif content:
                out["tool_calls"] = [{"index": 0, "function": {"arguments": content}}]
            return out
        if self.tool_mode == "auto" or self.tool_mode == "required":
            stream = self._tool_stream if self.tool_mode == "auto" else self._required
            first = stream.num_calls
            content, found = stream.feed(content, final)
            if self.max_calls is not None:
                found = found[:max(0, self.max_calls - first)]
            if found:
                self.has_calls = True
                out["tool_calls"] = [c.openai(first + i) for i, c in enumerate(found)]
        if content:
            out["content"] = content
        return out
