"""What a route group tells the app for its /openapi.json."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel


@dataclass
class RouteDocs:
    """The request bodies of a group's POST routes (path -> validating model), and the stream
    chunk models its routes' event streams refer to."""

    request_bodies: dict[str, type[BaseModel]]
    stream_chunks: tuple[type[BaseModel], ...] = ()
