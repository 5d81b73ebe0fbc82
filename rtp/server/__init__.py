"""OpenAI-compatible HTTP server on rank 0: async engine driver, FastAPI app, metrics, uvicorn runner."""

from rtp.server.api import build_app
from rtp.server.async_engine import AsyncEngine, EngineDeadError, RequestStream, ServerShuttingDownError
from rtp.server.runner import bind_socket, run_server

__all__ = [
    "AsyncEngine", "EngineDeadError", "RequestStream", "ServerShuttingDownError", "bind_socket", "build_app",
    "run_server",
]
