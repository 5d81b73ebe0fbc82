"""RequestStream's hand-off from the engine's thread: a step's items in one wake-up of the event loop, and a
reader that fell behind getting the waiting steps as one update (an error behind them after them)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rtp.errors import RequestError
from rtp.outputs import RequestOutput, delta
from rtp.server.async_engine import RequestStream, put_all


class _Owner:
    def __init__(self) -> None:
        self.forgotten: list[tuple[str, bool]] = []

    def _forget(self, request_id: str, abort: bool) -> None:
        self.forgotten.append((request_id, abort))


def _step(out: RequestOutput, token: int, finish: str | None = None) -> RequestOutput:
    """Add one token (its text: ``<token>``) to ``out`` as the engine does; returns the step's delta."""
    piece = f"<{token}>"
    out.token_ids.append(token)
    out.text += piece
    out.new_token_ids, out.new_text, out.finish_reason = [token], piece, finish
    return delta(out)


def test_a_steps_items_wake_the_loop_once(monkeypatch):
    """put_all from another thread: one call_soon_threadsafe for 64 streams' items, each in its own queue."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: (calls.append(a), real(*a))[1])
        owner = _Owner()
        streams = [RequestStream(owner, f"r{i}", loop) for i in range(64)]
        outs = [RequestOutput(f"r{i}", None, [1]) for i in range(64)]
        items = [(s, _step(o, i, "length")) for i, (s, o) in enumerate(zip(streams, outs))]
        thread = threading.Thread(target=put_all, args=(items,))
        thread.start()
        thread.join()
        got = [await anext(s) for s in streams]
        assert len(calls) == 1
        assert [o.token_ids for o in got] == [[i] for i in range(64)] and all(o.finished for o in got)
        assert not owner.forgotten  # finished streams abort nothing

    asyncio.run(main())


def test_a_reader_behind_gets_the_waiting_steps_as_one_update():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = RequestStream(_Owner(), "r", loop)
        out = RequestOutput("r", None, [1])
        put_all([(stream, _step(out, 5)), (stream, _step(out, 6))])
        first = await anext(stream)  # the first step alone (the first token)
        assert (first.token_ids, first.text, first.new_token_ids) == ([5], "<5>", [5])
        put_all([(stream, _step(out, t)) for t in (7, 8)])  # two more steps before the reader comes back
        await asyncio.sleep(0)  # (the loop runs the hand-off)
        got = await anext(stream)
        assert got is first  # the same object, updated
        assert (got.token_ids, got.new_token_ids, got.new_text) == ([5, 6, 7, 8], [6, 7, 8], "<6><7><8>")
        assert got.text == "<5><6><7><8>" and not got.finished
        put_all([(stream, _step(out, 9)), (stream, RequestError("refused"))])
        got = await anext(stream)
        assert (got.new_token_ids, got.text) == ([9], "<5><6><7><8><9>")  # the step before the error first
        with pytest.raises(RequestError, match="refused"):
            await anext(stream)
        assert stream.closed
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(main())


def test_a_finished_update_ends_the_join():
    """The finishing step's delta is the last a stream yields; nothing after it is joined into it."""

    async def main() -> None:
        stream = RequestStream(_Owner(), "r", asyncio.get_running_loop())
        out = RequestOutput("r", None, [1])
        put_all([(stream, _step(out, 4)), (stream, _step(out, 5)), (stream, _step(out, 6, "stop"))])
        await anext(stream)
        got = await anext(stream)
        assert (got.token_ids, got.new_token_ids, got.finish_reason, got.text) == ([4, 5, 6], [5, 6], "stop",
                                                                                   "<4><5><6>")
        assert type(got.__dict__["_text"]) is str  # fixed at the finish
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(main())
