"""The app's route groups, one module each; a new group is a class with ``register(app) -> RouteDocs``
built from the :class:`rtp.server.context.ServerContext`, listed in :data:`ROUTE_GROUPS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from fastapi import FastAPI

from rtp.server.context import ServerContext
from rtp.server.routes.docs import RouteDocs
from rtp.server.routes.generation import GenerationRoutes
from rtp.server.routes.info import InfoRoutes
from rtp.server.routes.responses import ResponsesRoutes


class RouteGroup(Protocol):
    """Routes of one kind, registered on an app."""

    def register(self, app: FastAPI) -> RouteDocs: ...


ROUTE_GROUPS: tuple[Callable[[ServerContext], RouteGroup], ...] = (GenerationRoutes, ResponsesRoutes, InfoRoutes)
"""In registration order (the order of /openapi.json's paths)."""

__all__ = ["ROUTE_GROUPS", "RouteDocs", "RouteGroup"]
