"""Speculative decoding (n-gram, k = 4) end to end in one process: the outputs equal rtp's own without
speculation and HF transformers' greedy, token for token; sampled outputs have the target's distribution.
The tests on ``spec_engine`` run again with a draft model (k = 3; the trained model as its own draft, so
its drafts are often accepted): the verification is the same, the proposer another.

The trained default model loops ("the king, the king ...") under greedy decoding, so its drafts are
accepted often; the random tiny Qwen3 is the held-out-style check. Every test asserts that drafts were
accepted, so none passes by never speculating.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.assets import trained_model_dir
from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig, SpeculativeConfig
from rtp.distributed.parallel import ParallelState
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import ModelRunner
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir
from tests.utils import hf_greedy

BLOCK = 16
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=None)


def make_engine(model_dir, spec: SpeculativeConfig | None = None, *, budget: int = 256, blocks: int = 64,
                caching: bool = True, max_num_seqs: int = 16) -> Engine:
    config = RtpConfig(
        model=ModelConfig(dtype="float32"), parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        speculative_config=spec or SpeculativeConfig(),
    )
    return Engine(config, ModelRunner(ParallelState.single("cpu"), model_dir, config), model_dir)


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], late: int = 0) -> list:
    """Outputs of ``requests``; the last ``late`` are submitted after four steps (prefills beside drafts)."""
    early = requests[: len(requests) - late]
    ids = [engine.add_request(p, sp) for p, sp in early]
    done = {}
    for step in range(3000):
        if step == 4:
            ids += [engine.add_request(p, sp) for p, sp in requests[len(early) :]]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if step >= 4 and not engine.has_unfinished():
            return [done[i] for i in ids]
    raise AssertionError("requests did not finish")


@pytest.fixture(scope="module")
def trained():
    return trained_model_dir()


@pytest.fixture(scope="module")
def tiny():
    return default_model_dir()


@pytest.fixture(scope="module")
def plain_engine(trained):
    return make_engine(trained)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_engine(trained, request):
    if request.param == "ngram":
        return make_engine(trained, NGRAM)
    return make_engine(trained, SpeculativeConfig(method="draft_model", model=str(trained), num_speculative_tokens=3,
                                                  disable_by_batch_size=None))


def prompts_of(engine: Engine) -> list[list[int]]:
    """Mixed lengths (3 to ~60 tokens), some repetitive."""
    texts = ["The king", "If music be the food of love, play on;",
             "the king, the king, the king, the king, and the king's son, the king",
             "Now is the winter of our discontent made glorious summer by this sun of York; "
             "and all the clouds that lour'd upon our house"]
    return [engine.tokenize(t) for t in texts]


def test_greedy_equals_no_speculation_and_hf(trained, plain_engine, spec_engine):
    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    prompts = prompts_of(plain_engine)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [hf_greedy(hf, p, 48) for p in prompts]
    # One more request, submitted late, wants prompt logprobs: its prefill shares a step with others' drafts.
    with_plp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    reqs = [(p, greedy) for p in prompts] + [(prompts[3], with_plp)]
    before = spec_engine.stats()["spec_num_accepted_tokens"]
    got = run(spec_engine, reqs, late=1)
    assert [o.token_ids for o in got[:-1]] == want
    plain = run(plain_engine, reqs, late=1)
    assert [o.token_ids for o in plain[:-1]] == want
    assert got[-1].token_ids == plain[-1].token_ids
    for a, b in zip(plain[-1].prompt_logprobs[1:], got[-1].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4
    assert spec_engine.stats()["spec_num_accepted_tokens"] - before > 20


def test_greedy_random_model_chunked_prefill_mixed_steps_and_preemption(tiny):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    # Repetitive prompts (a random model continues a loop it has seen); lengths 5 to 70.
    prompts = [(torch.randint(0, 400, (p,), generator=gen).tolist() * 10)[:n]
               for p, n in [(2, 5), (3, 33), (5, 70), (4, 20), (7, 47), (3, 12)]]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [hf_greedy(hf, p, 40) for p in prompts]
    # A budget of 24 tokens chunks every long prompt into steps that also verify others' drafts; 14 blocks of
    # 16 slots cannot hold six sequences of 45-110 tokens: sequences are preempted and recomputed.
    engine = make_engine(tiny, NGRAM, budget=24, blocks=14)
    got = run(engine, [(p, greedy) for p in prompts])
    assert [o.token_ids for o in got] == want
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == 14  # every block came back
    plain = make_engine(tiny, budget=24, blocks=14)
    assert [o.token_ids for o in run(plain, [(p, greedy) for p in prompts])] == want


def test_n_choices_fork_from_a_prompts_one_token_last_chunk(trained):
    # 33 tokens in a budget of 32: the last prefill chunk is one token, whose sample is every choice's first token
    # and the point the other choices fork from; it was drafted for as if decoding, and the forks were lost (hang).
    spec, plain = make_engine(trained, NGRAM, budget=32), make_engine(trained, budget=32)
    prompt = [1832, 385, 2452] * 11
    params = SamplingParams(temperature=0, max_tokens=8, n=2, ignore_eos=True)
    got, want = run(spec, [(prompt, params)])[0], run(plain, [(prompt, params)])[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [len(c.token_ids) for c in got.outputs] == [8, 8]
    counts = ("num_prefills", "num_prefill_tokens_computed", "num_decode_tokens")
    assert [spec.stats()[k] for k in counts] == [plain.stats()[k] for k in counts]


def test_stops_inside_an_accepted_run_end_where_decoding_without_drafts_ends(plain_engine, spec_engine):
    prompt = prompts_of(plain_engine)[2]
    free = run(plain_engine, [(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))])[0]
    stop_token = free.token_ids[17]
    text_stop = plain_engine.tokenizer.decode(free.token_ids[20:22]).strip()
    cases = [
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # max_tokens mid-run
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token], min_tokens=9),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, stop=[text_stop], ignore_eos=True),
    ]
    before = spec_engine.stats()["spec_num_accepted_tokens"]
    want = run(plain_engine, [(prompt, sp) for sp in cases])
    got = run(spec_engine, [(prompt, sp) for sp in cases])
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert [len(o.token_ids) for o in got][0] == 13
    assert spec_engine.stats()["spec_num_accepted_tokens"] > before


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.4, top_p=0.9, seed=1, max_tokens=40, logprobs=3),
    SamplingParams(temperature=0.2, top_k=20, min_p=0.05, seed=2, max_tokens=40, logprobs=1,
                   presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.05),
    SamplingParams(temperature=0.3, seed=3, max_tokens=40, logit_bias={11: 1.5}, min_tokens=30,
                   bad_words=["Romeo"], logprobs=0),
    SamplingParams(temperature=0.3, seed=4, n=3, max_tokens=30, logprobs=2),  # forks, then drafts
], ids=["top_p", "penalties_top_k_min_p", "bias_min_tokens_bad_words", "n3"])
def test_seeded_sampling_with_every_feature_gives_the_same_tokens_and_logprobs(plain_engine, spec_engine, params):
    # The verification of a draft samples its row with the seed's uniform of that generation step, so a
    # seeded request gets the very tokens it gets without speculation; logprobs come from the same logits.
    prompt = prompts_of(plain_engine)[2]
    before = spec_engine.stats()["spec_num_accepted_tokens"]
    [want] = run(plain_engine, [(prompt, params)])
    [got] = run(spec_engine, [(prompt, params)])
    assert spec_engine.stats()["spec_num_accepted_tokens"] > before  # this request's drafts were accepted
    for ws, gs in zip(want.samples or [want], got.samples or [got]):
        assert gs.token_ids == ws.token_ids
        assert len(gs.logprobs) == len(ws.logprobs) == len(ws.token_ids)
        for a, b in zip(ws.logprobs, gs.logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_grammar_masks_apply_per_draft_position(trained, plain_engine, spec_engine):
    xgr = pytest.importorskip("xgrammar")
    del xgr
    from rtp.structured import GrammarCompiler, GrammarSpec

    tok = plain_engine.tokenizer
    compiler = GrammarCompiler(tok, 4096, list(plain_engine.eos_token_ids))
    spec = GrammarSpec("regex", "(the king, )+and so", "regex")
    make = compiler.constraint_factory(compiler.compile(spec), spec)
    prompt = prompts_of(plain_engine)[2]
    sp = SamplingParams(temperature=0, max_tokens=40, constraint=make, logprobs=1)
    # A draft model's drafts ignore the grammar (its argmax leaves "the king, " here): the grammar cuts them
    # before the step is scheduled, so none is verified only to be rejected. N-gram drafts follow the
    # output's own repetition, which the grammar allows: they are verified under the masks and accepted.
    ngram = spec_engine.config.speculative_config.method == "ngram"
    counter = "spec_num_accepted_tokens" if ngram else "spec_num_refused_draft_tokens"
    before = spec_engine.stats()
    want = run(plain_engine, [(prompt, sp)])[0]
    got = run(spec_engine, [(prompt, sp)])[0]
    after = spec_engine.stats()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert after[counter] > before[counter]
