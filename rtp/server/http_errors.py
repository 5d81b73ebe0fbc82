"""How failures reach an HTTP client: the exception of a failed request mapped to an ApiError.

Every error leaves the server as OpenAI's error body (see
:class:`rtp.server.protocol.ApiError`); what is not an ApiError yet becomes one
here, with the traceback of an unexpected one logged once.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any

from rtp.errors import RequestError, RtpError
from rtp.log import get_logger
from rtp.server.async_engine import EngineDeadError, ServerShuttingDownError
from rtp.server.protocol import ApiError

logger = get_logger(__name__)

# pydantic names union members in error locations ("prompt", "str"); they are no field names.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|literal\[.*|function-.*|.*\[.*\].*)$")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def param_of(loc: tuple[Any, ...]) -> str:
    """The request field a pydantic error location names (union member tags left out)."""
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and _TYPE_TAG.match(x)))


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # escaped, or as the bytes json.loads lets pass


def lone_surrogate(body: bytes, data: Any) -> tuple[Any, ...] | None:  # noqa: ANN401 - parsed JSON
    """The location of the first string of ``data`` (``body`` parsed) holding a lone UTF-16 surrogate, which JSON
    allows ("\\ud800") and UTF-8 (the tokenizer) cannot carry; None where there is none (the usual case: the body
    alone says so)."""
    if not _SURROGATE.search(body):
        return None
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return loc
        elif isinstance(value, dict):
            for k, v in reversed(list(value.items())):
                # A key is text too (a tool's parameter names reach the prompt); its place is named escaped.
                shown = k.encode(errors="backslashreplace").decode()
                stack += [((*loc, shown), v), ((*loc, shown), k)]
        elif isinstance(value, list):
            stack.extend(((*loc, i), v) for i, v in reversed(list(enumerate(value))))
    return None


def runtime_error(e: Exception, prompt_param: str) -> ApiError:
    """The HTTP error for an exception raised while submitting or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestError):
        m = re.match(r"SamplingParams\.(\w+)=", str(e))
        return ApiError(400, str(e), e.param or (m.group(1) if m else prompt_param))
    if isinstance(e, (EngineDeadError, ServerShuttingDownError)):
        return ApiError(503, str(e), type="server_error", code="service_unavailable")
    if isinstance(e, RtpError):
        return ApiError(500, str(e), type="server_error")
    logger.error("request failed", exc_info=e)
    return ApiError(500, "internal server error (see the server log)", type="server_error")


def guard(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turn an unexpected exception into ApiError(500) here, so its traceback is logged once."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except (ApiError, ClientGone):
            raise
        except Exception as e:  # noqa: BLE001
            logger.error("unexpected error in %s", fn.__name__, exc_info=e)
            raise ApiError(500, "internal server error (see the server log)", type="server_error") from None

    return wrapper

