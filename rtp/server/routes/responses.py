"""The Responses route: POST /v1/responses, OpenAI's Responses API over the chat path (rtp.server.responses_api)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from rtp.server.context import ServerContext
from rtp.server.http_errors import guard
from rtp.server.responses_api import create_response
from rtp.server.responses_protocol import ResponsesRequest
from rtp.server.responses_schemas import STREAM_EVENTS, ResponseObject, responses_sse
from rtp.server.routes.docs import RouteDocs
from rtp.server.schemas import error_responses


class ResponsesRoutes:
    """/v1/responses of one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def register(self, app: FastAPI) -> RouteDocs:
        """Add the route to ``app``; returns its request body and stream events for /openapi.json."""
        app.add_api_route("/v1/responses", guard(self.responses), methods=["POST"],
                          dependencies=[Depends(self.ctx.auth)], summary="Create a response (OpenAI's Responses API)",
                          responses={200: {"model": ResponseObject}, **error_responses(400, 401, 404, 413, 500, 503)},
                          openapi_extra=responses_sse())
        return RouteDocs({"/v1/responses": ResponsesRequest}, stream_chunks=STREAM_EVENTS)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses."""
        return await create_response(self.ctx, request)
