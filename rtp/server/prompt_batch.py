"""/v1/completions with a list of prompts: one engine request per prompt, one response for all.

OpenAI's and vLLM's shape: ``"prompt": ["a", "b"]`` (or a list of token-id lists) answers one
choice per prompt and sample, choice ``i * n + j`` being sample ``j`` of prompt ``i``, in index
order; ``usage`` sums every prompt's tokens (each prompt counted once, every choice's completion
tokens). A stream interleaves the prompts' chunks as they come, each choice carrying its index,
and ends with one usage chunk (``stream_options.include_usage``) and one ``data: [DONE]``.

Each prompt goes through the single-prompt path (``submit``, ``collect``, ``stream_events`` of the
API): tokenization, limits, metrics and disconnect handling are the same. A prompt that is
refused (400) fails the whole request before anything was generated; a request that fails later
ends every other prompt's request too (they are aborted in the engine).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rtp.outputs import RequestOutput
from rtp.server.async_engine import RequestStream
from rtp.server.http_errors import ClientGone, runtime_error
from rtp.server.protocol import CompletionRequest
from rtp.server.responses import ResponseBuilder
from rtp.server.sse import ClosingEventStream, json_text

if TYPE_CHECKING:
    from rtp.server.context import ServerContext

_DONE = "data: [DONE]\n\n"


class _PromptBuilder(ResponseBuilder):
    """The builder of prompt ``i``: its choices are numbered from ``base = i * n``.

    A stream's usage chunk is not sent per prompt: :meth:`usage_chunk` keeps the usage for the sum
    and marks the event it returns, which the merger then drops.
    """

    def __init__(self, *args: Any, base: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.base = self.index = base
        self.final_usage: dict[str, Any] | None = None
        self.usage_pending = False

    def for_choice(self, index: int) -> ResponseBuilder:
        b = super().for_choice(index)
        b.index = self.base + index
        return b

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        self.final_usage, self.usage_pending = self.usage(out), True
        return super().usage_chunk(out)


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def batch_completions(api: ServerContext, request: Request, req: CompletionRequest) -> Response:
    """The response to a /v1/completions request with several prompts (see the module docstring)."""
    prompts = req.prompts()
    constraint = await api.constraint(req.grammar_spec())
    rid = f"cmpl-{uuid.uuid4().hex}"
    n = req.n or 1
    streams: list[RequestStream] = []
    builders: list[_PromptBuilder] = []
    counts: list[int] = []
    try:
        for i, prompt in enumerate(prompts):
            # Errors name the prompt's place in the list, e.g. "prompt.2".
            stream, ids, _, _ = await api.submit(req, prompt, req.logprobs, "cmpl", f"prompt.{i}", constraint)
            streams.append(stream)
            counts.append(len(ids))
            build = _PromptBuilder("text_completion", rid, api.model_name, api.tokenizer, len(ids), req.logprobs,
                                   base=i * n)
            build.prompt_logprobs, build.continuous_usage = req.prompt_logprobs, req.continuous_usage
            build.prompt_only = req.prompt_only
            if req.echo:
                build.echo = await api.echo_text(req, prompt, ids)
            builders.append(build)
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    if req.stream:
        return ClosingEventStream(_merged_events(api, streams, counts, builders, req.include_usage), streams)
    return JSONResponse(await _collect_all(api, request, streams, counts, builders))


async def _collect_all(api: ServerContext, request: Request, streams: list[RequestStream], counts: list[int],
                       builders: list[_PromptBuilder]) -> dict[str, Any]:
    tasks = [asyncio.ensure_future(api.collect(request, s, c)) for s, c in zip(streams, counts)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            e = failed.exception()
            if isinstance(e, ClientGone):
                raise e
            raise runtime_error(e, "prompt") from None  # type: ignore[arg-type]
        outs = [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()  # the others' streams close (and abort) as their collect() ends
        for s in streams:
            s.close()
    bodies = [b.full_response(out) for b, out in zip(builders, outs)]
    body = bodies[0]
    body["choices"] = [c for b in bodies for c in b["choices"]]
    body["usage"] = _sum_usage([b["usage"] for b in bodies])
    return body


async def _merged_events(api: ServerContext, streams: list[RequestStream], counts: list[int],
                         builders: list[_PromptBuilder], include_usage: bool) -> AsyncIterator[str]:
    """Every prompt's events in the order they come, one usage chunk and one [DONE] at the end."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        build = builders[i]
        events = api.stream_events(streams[i], counts[i], build, True)
        assert isinstance(events, AsyncGenerator)
        try:
            async for event in events:
                if event == _DONE:
                    break
                if build.usage_pending:  # this prompt's own usage chunk: summed below instead
                    build.usage_pending = False
                    continue
                await queue.put((i, event))
        finally:
            await events.aclose()
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        open_count = len(tasks)
        while open_count:
            _, event = await queue.get()
            if event is None:
                open_count -= 1
                continue
            yield event
            if event.startswith('data: {"error"'):
                break  # one prompt failed: the request has failed; the others are aborted below
        else:
            if include_usage and all(b.final_usage is not None for b in builders):
                usage = _sum_usage([b.final_usage for b in builders if b.final_usage is not None])
                first = builders[0]
                yield "data: " + json_text({"id": first.request_id, "object": "text_completion",
                                        "created": first.created, "model": first.model, "choices": [],
                                        "usage": usage}) + "\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()
    yield _DONE
