"""Speculative decoding on rank 0: proposers of draft tokens and the verification of drafts.

A proposer drafts up to ``k`` tokens per decoding sequence before a step
(:mod:`rtp.spec.ngram`); the scheduler budgets them and the step computes them
as query tokens; :mod:`rtp.spec.verify` accepts the longest run of drafts the
target model itself would have produced, plus the token after it, and
:mod:`rtp.spec.controller` decides who drafts how much and keeps the counters.
"""
