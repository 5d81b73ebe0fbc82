"""Engine with the real tiny model at TP=1 (in process): n > 1 forks, prompt logprobs, penalties.

References: separate n=1 requests (n > 1), HF transformers' log_softmax over the prompt (prompt
logprobs) and HF's greedy generate with its repetition-penalty processor.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.distributed.parallel import ParallelState
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import ModelRunner
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir
from tests.utils import hf_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_engine(model_dir, *, caching: bool = False, budget: int = 256, blocks: int = 64) -> Engine:
    config = RtpConfig(
        model=ModelConfig(dtype="float32"), parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
    )
    runner = ModelRunner(ParallelState.single("cpu"), model_dir, config)
    return Engine(config, runner, model_dir)


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            return [done[i] for i in ids]
    raise AssertionError("requests did not finish")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [21, 32])  # a partial last prompt block, and none
def test_n_samples_equal_separate_seeded_requests_with_one_prefill(model_dir, length: int) -> None:
    p = prompt(length, length)
    sp = SamplingParams(n=4, seed=100, temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = make_engine(model_dir)
    (out,) = run(engine, [(p, sp)])
    stats = engine.stats()
    assert stats["num_prefills"] == 1 and stats["num_prefill_tokens_computed"] == length  # one prefill
    tail = length % BLOCK  # each fork recomputes only its last partial prompt block (+ its first token)
    assert stats["num_fork_tail_tokens"] == (3 * (tail + 1) if tail else 0)
    assert stats["num_free_blocks"] == stats["num_blocks"]  # every shared block released
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) == 4  # distinct seeded samples
    assert out.token_ids == samples[0] and out.text == out.outputs[0].text
    assert out.num_completion_tokens == 48

    separate = make_engine(model_dir)
    singles = run(separate, [(p, SamplingParams(seed=100 + i, temperature=1.0, max_tokens=12, ignore_eos=True,
                                                logprobs=1)) for i in range(4)])
    assert samples == [o.token_ids for o in singles]
    assert [c.text for c in out.outputs] == [o.text for o in singles]
    for c, o in zip(out.outputs, singles):
        for a, b in zip(c.logprobs, o.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_n_samples_finishing_at_once_and_aborted(model_dir) -> None:
    engine = make_engine(model_dir, caching=True)
    p = prompt(19, 3)
    (out,) = run(engine, [(p, SamplingParams(n=3, max_tokens=1, seed=1))])
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
    assert all(c.finish_reason == "length" for c in out.outputs)
    rid = engine.add_request(p, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_n_samples_in_a_cache_their_forks_fill_equal_a_big_caches(model_dir, caching: bool) -> None:
    # 4 blocks: each request alone needs 3 (32 + 8 tokens), and its waiting fork holds its 2 prompt blocks, so the
    # running samples only fit once the forks give their blocks up (a crash before); seeded samples are the same.
    reqs = [(prompt(32, s), SamplingParams(n=2, seed=s, temperature=1.0, max_tokens=8, ignore_eos=True))
            for s in (1, 2)]
    small = make_engine(model_dir, caching=caching, blocks=4)
    got = run(small, reqs)
    want = run(make_engine(model_dir, caching=caching), reqs)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert all(len(c.token_ids) == 8 for o in got for c in o.outputs)
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_prompt_logprobs_match_hf_with_chunks_and_cache(model_dir, hf) -> None:
    # budget 24 < prompt: chunked prefill; prefix caching on and the prompt cached by a first request.
    engine = make_engine(model_dir, caching=True, budget=24)
    p = prompt(45, 9)
    other = prompt(30, 10)
    run(engine, [(p, SamplingParams(max_tokens=2))])
    outs = run(engine, [(other, SamplingParams(max_tokens=3)), (p, SamplingParams(max_tokens=3, prompt_logprobs=3)),
                        (p, SamplingParams(max_tokens=3))])
    got = outs[1].prompt_logprobs
    assert outs[0].prompt_logprobs is None and outs[2].num_cached_tokens > 0 and outs[1].num_cached_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)  # [len, vocab]
    assert got[0] is None and len(got) == len(p)
    for i in range(1, len(p)):
        entry = got[i]
        assert abs(entry[p[i]] - ref[i - 1, p[i]].item()) < 1e-4
        top = torch.topk(ref[i - 1], 3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-4
        assert len(entry) in (3, 4)


def test_repetition_penalty_matches_hf_greedy(model_dir, hf) -> None:
    p = prompt(12, 4)
    engine = make_engine(model_dir)
    outs = run(engine, [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.7)),
                        (p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, repetition_penalty=1.7,
                          min_new_tokens=20, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    assert outs[0].token_ids == ref
    assert outs[0].token_ids != outs[1].token_ids  # the penalty changed something; the plain row did not get it


def test_logit_bias_forces_a_token_and_bad_ids_are_rejected(model_dir) -> None:
    engine = make_engine(model_dir)
    outs = run(engine, [(prompt(5, 1), SamplingParams(temperature=1.0, max_tokens=6, logit_bias={42: 100.0})),
                        (prompt(5, 1), SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[7, 8]))])
    assert outs[0].token_ids == [42] * 6
    assert set(outs[1].token_ids) <= {7, 8}
    vocab = engine.runner.spec.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))


def test_bad_words_are_never_generated(model_dir) -> None:
    engine = make_engine(model_dir)
    tok = engine.tokenizer
    p = prompt(8, 6)
    (plain,) = run(engine, [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    # A generated token that is a word on its own: its text encodes back to it alone.
    target = next(t for t in plain.token_ids if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    (out,) = run(engine, [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             bad_words=[tok.decode([target])]))])
    assert target not in out.token_ids and out.token_ids != plain.token_ids


def test_a_request_shares_the_block_a_running_prompt_chunk_fills_in_the_same_step(model_dir, hf) -> None:
    """A 120-token prompt in chunks of 48: its last chunk (positions 96-119) fills block 6 in the step that admits a
    request sharing its first 112 tokens, which finds seven blocks in the cache (six before the scheduler registered
    a running chunk's blocks when it scheduled the chunk) and computes only its last 8 positions; both outputs are
    HF's."""
    engine = make_engine(model_dir, caching=True, budget=48)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a, b = prompt(120, 1), prompt(120, 1)[:112] + prompt(8, 2)
    ids = [engine.add_request(a, greedy)]
    done = {}
    for step in range(60):
        if step == 2:
            ids.append(engine.add_request(b, greedy))
            before = engine.stats()["prefix_hit_tokens"]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if step == 2:
            assert engine.stats()["prefix_hit_tokens"] - before == 112
        if step > 2 and not engine.has_unfinished():
            break
    assert [done[i].token_ids for i in ids] == [hf_greedy(hf, p, 6) for p in (a, b)]
