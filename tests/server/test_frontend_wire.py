"""The engine <-> frontend frames, and the frontend's text from token updates, against plain references."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from rtp.outputs import Logprob, merge, snapshot
from rtp.runtime.detokenizer import TokenDecoder
from rtp.runtime.model_info import GENERATION_CONFIG, ModelInfo
from rtp.sampling import SamplingParams
from rtp.server.frontend_outputs import FrontendRequest
from rtp.server.frontend_wire import (
    STAT_KEYS,
    EngineRequest,
    FrameReader,
    Kind,
    SampleUpdate,
    StepOutputs,
    decode_abort,
    decode_outputs,
    encode_abort,
    frame,
)
from rtp.structured import GrammarSpec
from rtp.testing import default_model_dir


def test_frames_survive_any_split_of_the_stream():
    frames = [frame(Kind.READY), encode_abort([1, 2, 4294967295]), frame(Kind.FAIL, "rank 1 died".encode()),
              frame(Kind.SHUTDOWN, b"x" * 100_000)]
    data = b"".join(frames)
    rng = random.Random(0)
    for _ in range(20):
        reader, got, pos = FrameReader(), [], 0
        while pos < len(data):
            n = rng.randint(1, 5000)
            got += reader.feed(data[pos : pos + n])
            pos += n
        assert [k for k, _ in got] == [Kind.READY, Kind.ABORT, Kind.FAIL, Kind.SHUTDOWN]
        assert decode_abort(got[1][1]) == [1, 2, 4294967295]
        assert bytes(got[2][1]) == b"rank 1 died"
        assert bytes(got[3][1]) == b"x" * 100_000


def test_a_request_round_trips_with_every_sampling_field():
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop=["\n\n", "END"],
                            stop_token_ids=[3], max_tokens=40, min_tokens=2, ignore_eos=True, logprobs=2,
                            skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.1, logit_bias={5: 3.0, 9: -100.0}, allowed_token_ids=[1, 5, 9],
                            bad_words=["foo"], prompt_logprobs=1, truncate_prompt_tokens=5)
    req = EngineRequest(12, "cmpl-abc", [5, 0, 2**31 - 1], params, GrammarSpec("regex", "[ab]+", "regex"))
    [(kind, payload)] = FrameReader().feed(req.encode())
    assert kind == Kind.ADD
    got = EngineRequest.decode(payload)
    assert (got.handle, got.request_id, got.prompt_token_ids, got.grammar) == (12, "cmpl-abc", [5, 0, 2**31 - 1],
                                                                              req.grammar)
    assert got.params == params and got.params.stop_strings == ["\n\n", "END"]


def test_step_outputs_round_trip():
    rng = random.Random(1)
    out = StepOutputs()
    expected = []
    for h in range(50):
        tokens = [rng.randrange(150_000) for _ in range(rng.randint(0, 4))]
        lps = None
        if h % 3 == 0:
            lps = [None if rng.random() < 0.2 else {t: -rng.random(), rng.randrange(9): -2.5} for t in tokens]
        reason = rng.choice([None, "stop", "length", "abort"])
        out.add(h, h % 4, tokens, reason, h * 16, lps)
        expected.append(SampleUpdate(h, h % 4, tokens, reason, h * 16, lps))
    out.errors[99] = "the prompt is too long"
    out.prompt_logprobs[3] = [None, {4: Logprob(-0.5, 1), 7: Logprob(-1.25, 2), 8: Logprob(-9.0, 4096)}]
    out.stats = {k: float(i) for i, k in enumerate(STAT_KEYS)}
    [(kind, payload)] = FrameReader().feed(out.encode())
    stats, updates, errors, plps = decode_outputs(payload)
    assert kind == Kind.OUTPUTS and stats == out.stats
    assert updates == expected
    assert errors == {99: "the prompt is too long"} and plps == {3: [None, {4: -0.5, 7: -1.25, 8: -9.0}]}
    assert [lp.rank for lp in plps[3][1].values()] == [1, 2, 4096]  # a prompt token's rank outside the top ones


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def info(tokenizer):
    return ModelInfo.load(default_model_dir(), len(tokenizer), 256)


def _request(info: ModelInfo, prompt: list[int], params: SamplingParams) -> FrontendRequest:
    return FrontendRequest("r", prompt, params, TokenDecoder(info.tokenizer), info.stop_reason_ids(params))


def _feed(req: FrontendRequest, tokens: list[int], reason_last: str | None, per_step: int = 1) -> str:
    """Apply ``tokens`` ``per_step`` at a time; returns the streamed text. At each step the output a stream
    builds from the deltas (what a frontend sends its streams) equals a whole copy of the request's."""
    streamed, built = "", None
    for i in range(0, len(tokens), per_step):
        chunk = tokens[i : i + per_step]
        req.begin_step()
        req.apply(SampleUpdate(1, 0, chunk, reason_last if i + per_step >= len(tokens) else None, 0), 0.0)
        streamed += req.output.new_text
        built = merge(built, req.delta())
        assert built == snapshot(req.output)
        if req.finished:
            break
    return streamed


def test_frontend_text_equals_one_shot_decode(tokenizer, info):
    text = "Once upon a time, in a land far away, there lived a fox. 你好世界 naïve café 😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Story:", add_special_tokens=False)
    for per_step in (1, 3):
        req = _request(info, prompt, SamplingParams(max_tokens=len(ids)))
        streamed = _feed(req, ids, "length", per_step)
        assert req.finished and req.output.finish_reason == "length"
        assert streamed == req.output.text == tokenizer.decode(ids)
        assert req.output.token_ids == ids


def test_frontend_stop_string_cuts_the_text_and_asks_for_an_abort(tokenizer, info):
    text = "The fox ran home. THE END and more text after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    kept = None
    for per_step in (1, 4):  # several tokens per step (speculative decoding): the same output as one by one
        req = _request(info, [1], SamplingParams(stop="THE END", max_tokens=100))
        streamed = _feed(req, ids, None, per_step)
        assert req.finished and req.output.finish_reason == "stop" and req.stopped_here
        assert streamed == req.output.text == text[: text.index("THE END")]
        kept = kept or req.output.token_ids
        assert req.output.token_ids == kept and len(kept) < len(ids)
        assert "THE END" in tokenizer.decode(kept) and "THE END" not in tokenizer.decode(kept[:-1])


def test_engine_stop_token_stays_out_of_the_text(tokenizer, info):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    req = _request(info, [1], SamplingParams(skip_special_tokens=False))
    _feed(req, ids + [eos], "stop")
    assert req.output.text == tokenizer.decode(ids) and req.output.token_ids == ids + [eos]
    assert not req.stopped_here  # the engine ended it: nothing to abort


def test_frontend_stop_reason_is_none_for_the_tokenizers_eos_alone(tokenizer, info):
    """As vLLM's: the tokenizer's EOS is checked first (stop_reason None, even where stop_token_ids name it)
    unless ignore_eos; the generation config's other EOS ids are stop tokens (stop_reason their id)."""
    eos = tokenizer.eos_token_id
    [other] = [t for t in json.loads((default_model_dir() / GENERATION_CONFIG).read_text())["eos_token_id"]
               if t != eos]
    for last, params, want in ((eos, SamplingParams(stop_token_ids=[eos]), None),
                               (other, SamplingParams(), other),
                               (eos, SamplingParams(ignore_eos=True, stop_token_ids=[eos]), eos)):
        req = _request(info, [1], params)
        _feed(req, [40, last], "stop")
        assert (req.output.finish_reason, req.output.stop_reason) == ("stop", want), params
