"""The generation routes: /v1/completions and /v1/chat/completions (streaming or not)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from rtp.server.context import ServerContext
from rtp.server.http_errors import guard
from rtp.server.prompt_batch import batch_completions
from rtp.server.protocol import ChatCompletionRequest, CompletionRequest
from rtp.server.responses import ResponseBuilder
from rtp.server.routes.docs import RouteDocs
from rtp.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    error_responses,
    sse_response,
)


class GenerationRoutes:
    """Completions and chat completions of one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def register(self, app: FastAPI) -> RouteDocs:
        """Add the routes to ``app``; returns their request bodies for /openapi.json."""
        auth = [Depends(self.ctx.auth)]
        generation_errors = error_responses(400, 401, 404, 413, 500, 503)
        app.add_api_route("/v1/completions", guard(self.completions), methods=["POST"], dependencies=auth,
                          summary="Create a completion",
                          responses={200: {"model": CompletionResponse}, **generation_errors},
                          openapi_extra=sse_response(CompletionResponse))
        app.add_api_route("/v1/chat/completions", guard(self.chat_completions), methods=["POST"],
                          dependencies=auth, summary="Create a chat completion",
                          responses={200: {"model": ChatCompletionResponse}, **generation_errors},
                          openapi_extra=sse_response(ChatCompletionChunk))
        return RouteDocs({"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest},
                         stream_chunks=(ChatCompletionChunk,))

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        ctx = self.ctx
        req: CompletionRequest = await ctx.read_body(request, CompletionRequest)
        ctx.check_model(req)
        req.check_supported()
        if len(req.prompts()) > 1:
            return await batch_completions(ctx, request, req)
        constraint = await ctx.constraint(req.grammar_spec())
        stream, ids, rid, _ = await ctx.submit(req, req.prompt_value(), req.logprobs, "cmpl", "prompt", constraint)
        build = ResponseBuilder("text_completion", rid, ctx.model_name, ctx.tokenizer, len(ids), req.logprobs)
        build.prompt_logprobs, build.prompt_only = req.prompt_logprobs, req.prompt_only
        if req.echo:
            build.echo = await ctx.echo_text(req, req.prompt_value(), ids)
        return await ctx.respond(request, req, stream, ids, build)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        ctx = self.ctx
        req: ChatCompletionRequest = await ctx.read_body(request, ChatCompletionRequest)
        ctx.check_model(req)
        req.check_supported()
        mode, tool_name = ctx.tool_mode(req)
        text = await ctx.render_chat(req.conversation(), req.tool_dicts(), req.chat_template_kwargs,
                                     req.add_generation_prompt, req.continue_final_message)
        spec = ctx.after_thinking(req.tool_grammar() or req.grammar_spec(), text)
        constraint = await ctx.constraint(spec)
        stream, ids, rid, _ = await ctx.submit(req, text, req.num_logprobs(), "chatcmpl", "messages", constraint)
        output = None
        if ctx.server.reasoning_parser is not None or mode != "none":
            output = ctx.chat_output(text, mode, tool_name, req.parallel_tool_calls is False, spec)
        build = ResponseBuilder("chat.completion", rid, ctx.model_name, ctx.tokenizer, len(ids),
                                req.num_logprobs(), output)
        build.prompt_logprobs = req.prompt_logprobs
        if req.echo and req.messages[-1].role == "assistant":  # as vLLM: only the reply's own role is echoed
            build.echo = req.messages[-1].text(len(req.messages) - 1)
        return await ctx.respond(request, req, stream, ids, build)
