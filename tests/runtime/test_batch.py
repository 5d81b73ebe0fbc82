"""The workers' BatchMirror, fed the scheduler's plans through the wire format, builds exactly the
inputs the scheduler meant: token ids, positions, KV slots and which rows are sampled."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rtp.core.scheduler import Scheduler, SchedulerConfig
from rtp.core.sequence import Sequence
from rtp.core.step import decode, encode
from rtp.runtime.batch import BatchMirror
from rtp.sampling import SamplingParams


def expected_inputs(result, block_size: int):
    ids, pos, slots, samples, offset = [], [], [], [], 0
    for item in result.scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        offset += n
        if item.needs_sample:
            samples.append(offset - 1)
    return ids, pos, slots, samples


@pytest.mark.parametrize("seed", range(5))
def test_mirror_rebuilds_the_schedulers_batch(seed):
    rng = random.Random(seed)
    block_size = 4
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128,
                                      block_size=block_size, num_blocks=20), eos_token_ids=[0])
    mirror = BatchMirror(block_size)
    shared = [rng.randrange(1, 50) for _ in range(9)]  # a common prefix: prefix-cache hits
    next_id, steps = 0, 0
    while steps < 300 and (next_id < 25 or sched.has_unfinished()):
        if next_id < 25 and rng.random() < 0.4:
            own = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            prompt = (shared if rng.random() < 0.5 else []) + own
            sched.add(Sequence(next_id, prompt, SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)))
            next_id += 1
        result = sched.schedule()
        if not result.scheduled:
            continue
        steps += 1
        batch = mirror.apply(decode(encode(result.plan)))
        ids, pos, slots, samples = expected_inputs(result, block_size)
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == slots
        assert batch.sample_indices.tolist() == samples
        assert batch.seq_ids == [item.seq.seq_id for item in result.scheduled]
        assert np.all(batch.block_tables >= 0)
        sched.postprocess(result, [rng.randrange(1, 50) for _ in samples])
    assert not sched.has_unfinished()
    assert sched.stats.num_preemptions > 0  # the small cache forces preempted sequences to be re-sent in full
    assert sched.stats.prefix_hit_tokens > 0
