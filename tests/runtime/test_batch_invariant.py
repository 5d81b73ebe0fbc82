"""model.batch_invariant: a request's logprobs, to the last bit, and so its tokens do not depend on the rest of
the batch nor on how its prompt is chunked (the real tiny model in bfloat16, in process).

The reference is the same request run alone; the other runs batch it with prompts of other lengths, chunked
prefills beside its decode steps, an n = 2 request and requests that arrive while it decodes; with too few KV
blocks (preempted, recomputed) and from the prefix cache. Without the mode
the same scenario changes its logprobs (decode attention splits a sequence's keys by batch size, and mixed
steps take another kernel): checked too, so that the scenario keeps exercising what the mode is for.
"""

from __future__ import annotations

import pytest
import torch

from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import ModelRunner
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir


def make_engine(invariant: bool, dtype: str = "bfloat16", blocks: int = 256, caching: bool = False,
                **model: object) -> Engine:
    config = RtpConfig(
        model=ModelConfig(dtype=dtype, batch_invariant=invariant, **model), parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=16, num_kv_blocks=blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
    )
    return Engine(config, ModelRunner(ParallelState.single("cpu"), default_model_dir(), config), default_model_dir())


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# A prompt longer than the step budget (chunked as 64 + 64 + 22 alone, elsewhere beside the others), sampled with a
# seed; and a short greedy one.
TARGETS = [(prompt(150, 1), SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True, logprobs=0)),
           (prompt(5, 2), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0))]


def run(engine: Engine, crowd: bool) -> list[tuple[list[int], list[float]]]:
    """The targets' tokens and their logprobs; with ``crowd``, among other requests (some arriving later)."""
    ids = [engine.add_request(p, sp) for p, sp in TARGETS]
    if crowd:
        for i, n in enumerate((90, 3, 130)):
            engine.add_request(prompt(n, 10 + i), SamplingParams(temperature=0.8, seed=i, max_tokens=30,
                                                                  ignore_eos=True))
        engine.add_request(prompt(21, 20), SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True))
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if crowd and steps in (6, 15):  # prefills arriving while the targets decode: mixed steps
            engine.add_request(prompt(70 + steps, steps), SamplingParams(max_tokens=8, ignore_eos=True))
        assert steps < 2000
    return [(done[i].token_ids, [e[t] for t, e in zip(done[i].token_ids, done[i].logprobs)]) for i in ids]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_requests_logprobs_do_not_depend_on_the_batch(dtype):
    alone = run(make_engine(True, dtype), crowd=False)
    assert run(make_engine(True, dtype), crowd=True) == alone  # token ids and logprobs, exactly
    tight = make_engine(True, dtype, blocks=24)  # too few blocks for the crowd: sequences are preempted, recomputed
    assert run(tight, crowd=True) == alone and tight.scheduler.counters.num_preemptions > 0
    cached = make_engine(True, dtype, caching=True)  # the second time the targets' prompts come from the cache
    assert run(cached, crowd=False) == alone and run(cached, crowd=True) == alone
    if dtype == "float32":  # (in bfloat16 the tiny model's outputs round the differences away)
        assert run(make_engine(False, dtype), crowd=True) != run(make_engine(False, dtype), crowd=False)


def test_what_the_mode_does_not_cover_is_refused():
    with pytest.raises(ConfigError, match="quantization='int8'"):
        make_engine(True, quantization="int8")
    with pytest.raises(ConfigError, match="float32 and bfloat16, not torch.float16"):
        make_engine(True, "float16")
