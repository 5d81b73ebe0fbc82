"""The start-up heap of rtp's long-lived processes, kept out of the garbage collector's full passes.

A full (generation 2) collection walks every object the collector tracks. A server's heap after start-up
is large and stays alive to the end (an API frontend: ~255k objects, FastAPI, pydantic, the tokenizer's
Python side): each full pass over it took ~145 ms of the frontend's event loop on a 2-core host, a pause
of every stream, and the collector's passes were 17% of the frontend's CPU while it streamed. Frozen
(``gc.freeze``) once start-up is over, those objects are never walked again; what is made while serving
is collected as before.
"""

from __future__ import annotations

import gc

from rtp.log import get_logger

logger = get_logger(__name__)


def freeze_startup_heap(what: str) -> None:
    """Collect once, then leave every object alive now out of later collections (call when ``what``, a
    process of rtp's own, has started and is about to serve until it exits)."""
    gc.collect()
    gc.freeze()
    logger.debug("%s: %d start-up objects left out of garbage collection", what, gc.get_freeze_count())
