"""The sampling half of a step with drafts: one batched sampler call over every verification row, then
the accepted run of each sequence (rank 0's engine calls :func:`sample_runs`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp.core.schedule_types import ScheduleResult
from rtp.core.sequence import Sequence
from rtp.runtime.output_processor import OutputProcessor, SampleState
from rtp.runtime.sampler import Sampler, SampleRow, argmax_rows
from rtp.spec.verify import accepted_run, verification_rows


@dataclass
class Runs:
    """One step's tokens per sampled sequence (batch order), then those of the forks made in this step."""

    seqs: list[Sequence]
    runs: list[list[int]]
    """Per sequence: its sampled token, or with drafts its accepted drafts and the next token."""
    logprobs: list[list[dict[int, float] | None]]
    """Per sequence, one entry per token of its run (None where no logprobs are asked for)."""
    num_rows: int
    """Of them, the sequences of the step (the forks follow)."""
    num_drafts: list[int]
    """Per sequence of the step: draft tokens it verified."""
    forks: dict[int, list[tuple[Sequence, int]]] | None = None
    """Parent sequence id -> (fork, its first token), for the scheduler (n > 1)."""


def sample_runs(
    sampler: Sampler, outputs: OutputProcessor, result: ScheduleResult, logits: torch.Tensor,
    take_forks: Callable[[list[SampleState]], list[tuple[int, SampleState]]],
) -> Runs:
    """Sample every verification row of ``logits`` (``1 + drafts`` consecutive rows per sampled sequence,
    as the step returns them) and cut each sequence's run at its first rejected draft."""
    assert result.drafts is not None
    picked = [(seq, d) for seq, ns, d in zip(result.seqs, result.needs_sample, result.drafts) if ns]
    seqs = [seq for seq, _ in picked]
    drafts = [d for _, d in picked]
    counts = [1 + len(d) for d in drafts]
    assert logits.shape[0] == sum(counts), (tuple(logits.shape), counts)
    starts = list(itertools.accumulate(counts, initial=0))
    fork_rows: list[tuple[int, SampleState]] = []
    if not outputs.full_sample_ids:  # every request plain greedy: one argmax over all rows
        drawn = argmax_rows(logits).tolist()
        lps: list[dict[int, float] | None] = [None] * len(drawn)
    else:
        samples = [outputs.samples[seq.seq_id] for seq in seqs]
        vocab = logits.shape[1]
        rows: list[SampleRow] = []
        for smp, d in zip(samples, drafts):
            rows += verification_rows(smp.row(), d, vocab)
        fork_rows = take_forks(samples)  # (index of the parent in seqs, fork); a parent never drafts
        if fork_rows:
            src = torch.tensor([starts[j] for j, _ in fork_rows], device=logits.device)
            logits = torch.cat([logits, logits[src]])
            rows += [smp.row() for _, smp in fork_rows]
        out = sampler.sample(logits, rows)
        drawn, lps = out.token_ids, out.logprobs
    runs: list[list[int]] = []
    run_lps: list[list[dict[int, float] | None]] = []
    for i, d in enumerate(drafts):
        group = drawn[starts[i] : starts[i + 1]]
        run = accepted_run(d, group)
        runs.append(run)
        run_lps.append(lps[starts[i] : starts[i] + len(run)])
    result_runs = Runs(seqs, runs, run_lps, len(seqs), [len(d) for d in drafts])
    if fork_rows:
        result_runs.forks = {}
        base = starts[-1]
        for n, (j, smp) in enumerate(fork_rows):
            tok = drawn[base + n]
            result_runs.forks.setdefault(seqs[j].seq_id, []).append((smp.seq, tok))
            result_runs.seqs.append(smp.seq)
            result_runs.runs.append([tok])
            result_runs.logprobs.append([lps[base + n]])
    return result_runs
