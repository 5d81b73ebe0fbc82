"""Rank 0 with pipeline stages: several steps in flight, so that every stage has work.

A step's plan goes to every rank as usual; rank 0 runs the first stage's part
(:meth:`ModelRunner.submit`) and, while later stages work on it, schedules the
next step over the requests that are not in flight. The last stage's final hidden
rows of the oldest step come back and rank 0 computes their logits
(:meth:`ModelRunner.collect`) once ``depth`` steps are in flight or nothing else
can be scheduled; that step is then sampled,
postprocessed and output exactly as a step of the plain engine loop, so the
tokens are the same ones (greedy: token for token).

A request in flight is not preempted, and not scheduled again until its step
returns (:attr:`InFlightSteps.busy`, the scheduler's ``busy``), except a prefill whose chunks in flight
sample nothing: its next chunk follows them, so one long prompt keeps every
stage busy too. An abort of a request in flight waits for its steps. Each
step takes at most an even share (1 / depth) of the live sequences. Every
stage runs the plans in the order rank 0 sent them, so a block freed by a later
plan is only reused after the earlier plans that wrote it have run there.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rtp.core.scheduler import ScheduleResult
from rtp.outputs import RequestOutput

if TYPE_CHECKING:
    from rtp.runtime.engine import Engine


class InFlightSteps:
    """Up to ``depth`` scheduled steps whose outputs have not come back from the last stage yet."""

    def __init__(self, engine: Engine, depth: int) -> None:
        self.engine, self.depth = engine, depth
        self.queue: deque[ScheduleResult] = deque()  # oldest first: outputs return in this order
        self.busy: dict[int, int] = {}
        """Sequences of the steps in flight: id -> tokens those steps compute of it."""
        self.num_overlapped = 0
        """Steps submitted while another one was in flight (the pipelining that happened)."""

    def step(self) -> list[RequestOutput]:
        """Schedule and submit one more step if there is room and work, else collect the oldest one."""
        e = self.engine
        changed = e.drain_inbox()
        submitted = False
        if len(self.queue) < self.depth:
            sched = e.scheduler
            # An even share of the live sequences per step in flight, so the steps keep every stage busy.
            live = len(sched.running) + sched.num_waiting
            result = sched.schedule(busy=self.busy, max_seqs=max(1, -(-live // self.depth)))
            plan = result.plan
            if plan.new_seqs or plan.cached_seqs or plan.freed_seq_ids:
                e.transport(plan)
                e.runner.submit(plan)
                self.queue.append(result)
                for seq, n in zip(result.seqs, result.num_new_tokens):
                    self.busy[seq.seq_id] = self.busy.get(seq.seq_id, 0) + n
                self.num_overlapped += len(self.queue) > 1
                submitted = True
        if self.queue and (not submitted or len(self.queue) >= self.depth):
            result = self.queue.popleft()
            out = e.runner.collect()
            for seq, n in zip(result.seqs, result.num_new_tokens):
                if (left := self.busy.pop(seq.seq_id, n) - n) > 0:
                    self.busy[seq.seq_id] = left  # a later chunk of it is still in flight
            e.finish_step(result, out, changed)
        return changed
