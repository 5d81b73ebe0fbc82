"""Runtime.generate's loop on rank 0, over a stand-in engine and transport (no model, no ranks)."""

from types import SimpleNamespace

import pytest

from rtp.errors import RtpError, WorkerDiedError
from rtp.runtime.coordinator import Runtime
from rtp.runtime.step_transport import StepTransport

STATS = dict.fromkeys(["num_prefill_tokens_computed", "num_decode_tokens", "prefix_hit_tokens", "num_preemptions"], 0)


class LostPeerTransport:
    """Every step fails as a lost rank does."""

    ps = SimpleNamespace(dp_size=1, dp_rank=0, dp_group=None)

    def run_step(self, step, fail_all):  # noqa: ANN001, ANN201
        raise WorkerDiedError("rank 1 (pid 7 on host h) was lost")


class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def add_request(self, prompt, params) -> str:  # noqa: ANN001
        return f"r{len(prompt)}"

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def stats(self) -> dict[str, int]:
        return dict(STATS)

    def step(self) -> list:
        return []

    def fail_all(self, message: str) -> None:
        pass


def test_a_failing_step_ends_the_progress_line_and_aborts_the_batch(capsys):
    # The bar is closed before the error leaves generate(), so the "error: ..." line printed next starts at
    # the beginning of a line (the multi-node tests and users' log filters match "^error:").
    engine = Engine()
    runtime = Runtime(engine, LostPeerTransport())  # type: ignore[arg-type]
    with pytest.raises(WorkerDiedError, match="was lost") as raised:
        runtime.generate_local([[1], [1, 2]], [None, None], use_tqdm=True)  # type: ignore[list-item]
    err = capsys.readouterr().err  # read while the traceback still holds the frame (and a bar left open)
    assert raised.value.__traceback__ is not None
    assert "generate:" in err and err.endswith("\n"), repr(err)
    assert engine.aborted == ["r1", "r2"]


def test_a_step_interrupted_in_the_middle_leaves_the_runtime_failed():
    # A second Ctrl-C raises inside a step: the workers may sit in its collectives and blocks the scheduler
    # registered for the step's KV were never written, so no later step may run (and close() skips the
    # shutdown handshake, as after any failed step).
    transport = object.__new__(StepTransport)  # only what run_step touches
    transport.watchdog = SimpleNamespace(failure=None)
    transport.heartbeat = SimpleNamespace(finish_step=lambda: None)
    transport.failed, transport.in_step, transport.stop_signal = None, False, None

    def interrupted() -> list:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transport.run_step(interrupted, lambda message: None)
    assert transport.failed is not None and not transport.in_step
    with pytest.raises(RtpError, match="failed earlier"):
        transport.run_step(lambda: [], lambda message: None)
