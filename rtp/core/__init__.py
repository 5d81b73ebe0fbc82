"""Rank-0 bookkeeping: sequences, KV blocks, scheduling, step messages. Pure Python."""
