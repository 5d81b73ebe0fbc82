"""Engine bookkeeping with a scripted model: finish reasons, stop strings, logprobs, aborts, ids.

The fake runner applies each StepPlan to a real BatchMirror and returns logits
that make the scripted token the clear argmax, so these tests exercise the
scheduler, sampler, detokenizer and engine together in milliseconds.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from rtp.config import ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.errors import ConfigError, RequestError
from rtp.outputs import RequestOutput, delta, join_deltas, merge, snapshot
from rtp.runtime.batch import BatchMirror
from rtp.runtime.engine import Engine
from rtp.runtime.input_processor import truncate_prompt
from rtp.runtime.model_info import GENERATION_CONFIG, ModelInfo, sampling_defaults_of
from rtp.runtime.model_runner import StepOutput
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir
from tests.utils import with_generation_config

VOCAB = 512


class ScriptedRunner:
    """Emits script[first prompt token][i] as the i-th generated token of a sequence."""

    def __init__(self, script: dict[int, list[int]], num_blocks: int = 64, block_size: int = 4) -> None:
        self.script = script
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, 256
        self.max_num_batched_tokens = 64  # the step budget the engine's scheduler takes from its runner
        self.spec = SimpleNamespace(vocab_size=VOCAB)
        self.mirror = BatchMirror(block_size)
        self.prompt_len: dict[int, int] = {}
        self.argmax_plans: list[bool] = []  # each step's plan.sample_argmax

    def execute(self, plan):
        self.argmax_plans.append(plan.sample_argmax)
        for new in plan.new_seqs:
            self.prompt_len.setdefault(new.seq_id, len(new.token_ids))
        batch = self.mirror.apply(plan)
        rows = []
        for seq_id in batch.seq_ids:
            seq = self.mirror.get(seq_id)
            if seq.num_computed != len(seq.token_ids):
                continue  # not sampled this step
            generated = len(seq.token_ids) - self.prompt_len[seq_id]
            tokens = self.script[seq.token_ids[0]]
            logits = torch.zeros(VOCAB)
            logits[tokens[min(generated, len(tokens) - 1)]] = 10.0
            rows.append(logits)
        logits = torch.stack(rows) if rows else None
        if plan.sample_argmax and logits is not None:  # as the TP ranks answer such a plan: tokens only
            return StepOutput(sample_tokens=logits.argmax(dim=1))
        return StepOutput(sample_logits=logits)


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


def make_engine(model_dir, script, **kw) -> Engine:
    config = RtpConfig(parallel=ParallelConfig(device="cpu"), scheduler=SchedulerConfig(max_num_seqs=8))
    return Engine(config, ScriptedRunner(script, **kw), model_dir)


def run(engine: Engine) -> dict:
    done = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            return done
    raise AssertionError("requests did not finish")


def test_eos_ends_with_stop_and_is_kept_in_ids_not_text(model_dir):
    engine = make_engine(model_dir, {})
    hello = engine.tokenizer.encode("hello world", add_special_tokens=False)
    eos = engine.tokenizer.eos_token_id
    engine.runner.script = {7: hello + [eos, 1, 2]}
    rid = engine.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=20))
    out = run(engine)[rid]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == hello + [eos]
    assert out.text == "hello world"


def test_ignore_eos_and_max_tokens_give_length(model_dir):
    engine = make_engine(model_dir, {})
    eos = engine.eos_token_ids[0]
    engine.runner.script = {7: [eos] * 10}
    rid = engine.add_request([7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = run(engine)[rid]
    assert out.finish_reason == "length" and out.token_ids == [eos] * 5


def test_stop_string_on_the_last_allowed_token_is_a_stop(model_dir):
    engine = make_engine(model_dir, {})
    ids = engine.tokenizer.encode("one two three", add_special_tokens=False)
    engine.runner.script = {7: ids}
    rid = engine.add_request([7], SamplingParams(temperature=0, max_tokens=len(ids), stop=["three"]))
    out = run(engine)[rid]
    assert out.finish_reason == "stop" and out.stop_reason == "three"
    assert out.text == "one two "


def test_stop_strings_wait_for_min_tokens(model_dir):
    engine = make_engine(model_dir, {})
    ids = engine.tokenizer.encode("stop and go and stop", add_special_tokens=False)
    engine.runner.script = {7: ids + ids}
    min_tokens = len(engine.tokenizer.encode("stop and", add_special_tokens=False))
    rid = engine.add_request([7], SamplingParams(temperature=0, max_tokens=40, stop=["stop"], min_tokens=min_tokens))
    out = run(engine)[rid]
    assert out.finish_reason == "stop"
    assert out.text.startswith("stop and go and ") and "stop" not in out.text[4:]


def test_truncate_prompt_tokens_keeps_the_prompts_end(model_dir):
    engine = make_engine(model_dir, {5: [20, 21]})
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    rid = engine.add_request([9] * 300 + [5, 6, 7], params)
    out = run(engine)[rid]  # 303 tokens would not fit max_model_len = 256
    assert out.prompt_token_ids == [5, 6, 7] and out.token_ids == [20, 21]
    # -1: fit the prompt to the context, leaving room for max_tokens; a prompt that fits stays whole
    rid = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=-1))
    assert run(engine)[rid].prompt_token_ids == [5, 6, 7]
    n = engine.max_model_len
    assert truncate_prompt(list(range(300)), -1, n) == list(range(300 - (n - 1), 300))  # vLLM's, no max_tokens
    rid = engine.add_request([5] * 300, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    out = run(engine)[rid]
    assert len(out.prompt_token_ids) == n - 2 and out.token_ids == [20, 21]
    for bad in (0, -2, 1.5):
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    for bad in (n, n + 1):  # no room left for a generated token
        with pytest.raises(RequestError, match=f"leaves no room in the model's context .max_model_len={n}"):
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, truncate_prompt_tokens=bad))
    assert truncate_prompt([1, 2], n - 1, n) == [1, 2]


def test_detokenize_false_gives_token_ids_only(model_dir):
    engine = make_engine(model_dir, {})
    ids = engine.tokenizer.encode("plain words here", add_special_tokens=False)
    engine.runner.script = {7: ids}
    on = engine.add_request([7], SamplingParams(temperature=0, max_tokens=len(ids)))
    off = engine.add_request([7], SamplingParams(temperature=0, max_tokens=len(ids), detokenize=False,
                                                 stop_token_ids=[ids[-1]]))
    done = run(engine)
    assert done[on].text == "plain words here" and done[on].token_ids == ids
    assert done[off].text == "" and done[off].token_ids == ids and done[off].stop_reason == ids[-1]
    with pytest.raises(RequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_a_stop_tokens_text_is_kept_with_include_stop_str_in_output(model_dir):
    """As vLLM's: the token that stops a request is in its token_ids; its text only with
    include_stop_str_in_output."""
    engine = make_engine(model_dir, {})
    ids = engine.tokenizer.encode("red green blue", add_special_tokens=False)
    engine.runner.script = {7: ids}
    stop = ids[len(engine.tokenizer.encode("red", add_special_tokens=False))]  # the first token of " green"
    rids = [engine.add_request([7], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop],
                                                   include_stop_str_in_output=keep)) for keep in (False, True)]
    done = run(engine)
    upto = ids[: ids.index(stop) + 1]
    assert [done[r].token_ids for r in rids] == [upto, upto]
    assert [done[r].text for r in rids] == [engine.tokenizer.decode(upto[:-1]), engine.tokenizer.decode(upto)]


def test_stop_reason_names_the_stop_string_or_token(model_dir):
    """vLLM's stop_reason: the stop string that matched (the earliest of several), the stop token id, else None;
    for every sample of an n > 1 request, the request's flat field being sample 0's."""
    engine = make_engine(model_dir, {})
    ids = engine.tokenizer.encode("red green blue", add_special_tokens=False)
    engine.runner.script = {7: ids + [1, 2], 8: [40, 41, 42, 43]}
    strings = engine.add_request([7], SamplingParams(temperature=0, max_tokens=20, stop=["blue", "green"]))
    token = engine.add_request([8], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[50, 42]))
    length = engine.add_request([8], SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[42]))
    multi = engine.add_request([8], SamplingParams(temperature=0, n=2, max_tokens=20, stop_token_ids=[43]))
    done = run(engine)
    assert (done[strings].finish_reason, done[strings].stop_reason) == ("stop", "green")
    assert (done[token].finish_reason, done[token].stop_reason) == ("stop", 42)
    assert done[token].outputs[0].stop_reason == 42
    assert (done[length].finish_reason, done[length].stop_reason) == ("length", None)
    assert [c.stop_reason for c in done[multi].outputs] == [43, 43] and done[multi].stop_reason == 43


def test_stop_reason_is_none_for_the_tokenizers_eos_alone(model_dir):
    """vLLM checks the tokenizer's EOS first (stop_reason None, even where stop_token_ids name it) unless
    ignore_eos; the generation config's other EOS ids are stop tokens (stop_reason their id) unless ignore_eos."""
    engine = make_engine(model_dir, {})
    eos = engine.tokenizer.eos_token_id
    [other] = [t for t in json.loads((model_dir / GENERATION_CONFIG).read_text())["eos_token_id"] if t != eos]
    engine.runner.script = {7: [40, eos, 41], 8: [40, other, 41, 42]}
    want = {
        engine.add_request([7], SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[eos])): ("stop", None),
        engine.add_request([8], SamplingParams(temperature=0, max_tokens=9)): ("stop", other),
        engine.add_request([7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop_token_ids=[eos])):
            ("stop", eos),
        engine.add_request([8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)): ("length", None),
    }
    done = run(engine)
    assert {rid: (done[rid].finish_reason, done[rid].stop_reason) for rid in want} == want


def test_logprobs_align_with_tokens(model_dir):
    engine = make_engine(model_dir, {7: [5, 6, 7, 8]})
    rid = engine.add_request([7, 1], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    out = run(engine)[rid]
    assert len(out.logprobs) == len(out.token_ids) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 2
        assert entry[token] == max(entry.values())
    for token, entry in zip(out.token_ids, out.logprobs):  # vLLM's Logprob fields
        assert entry[token].rank == 1 and entry[token].logprob == entry[token]
        assert all(lp.decoded_token == engine.tokenizer.decode([t]) for t, lp in entry.items())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))
    assert out.cumulative_logprob < 0 and out.outputs[0].cumulative_logprob == out.cumulative_logprob
    rid = engine.add_request([7, 1], SamplingParams(temperature=0, max_tokens=2))
    assert run(engine)[rid].cumulative_logprob is None  # as vLLM: only with logprobs


def test_abort_before_and_after_the_first_step_frees_everything(model_dir):
    engine = make_engine(model_dir, {7: list(range(10, 40))})
    free = engine.scheduler.stats.num_free_blocks
    a = engine.add_request([7] * 9, SamplingParams(temperature=0, max_tokens=30))
    engine.abort(a)  # before any step: must not run at all
    b = engine.add_request([7] * 9, SamplingParams(temperature=0, max_tokens=30))
    done = {out.request_id: out for out in engine.step() if out.finished}
    engine.abort(b)
    done |= run(engine)
    assert done[a].finish_reason == "abort" and done[a].token_ids == []
    assert done[b].finish_reason == "abort"
    stats = engine.scheduler.stats
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == free


def test_request_ids_are_unique_while_live_and_reusable_after(model_dir):
    engine = make_engine(model_dir, {7: [1, 2, 3]})
    engine.add_request([7], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([7], SamplingParams(max_tokens=2), request_id="x")
    run(engine)
    engine.add_request([7], SamplingParams(max_tokens=2), request_id="x")
    assert run(engine)["x"].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, words",
    [([], "empty"), ([VOCAB + 5], "out of range"), ([1] * 300, "max_model_len"), ("", "empty"), (3.5, "string")],
)
def test_bad_prompts_are_refused_at_submission(model_dir, prompt, words):
    engine = make_engine(model_dir, {})
    with pytest.raises(RequestError, match=words):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished()


def test_a_completion_past_the_context_ends_with_length_there(model_dir):
    """As in vLLM's offline engine: prompt + max_tokens past max_model_len (256) is not refused, the completion
    stops at the context with "length"; a request that fits in the same batch is unaffected."""
    engine = make_engine(model_dir, {7: [20, 21, 22, 23], 8: [30, 31]})
    long = engine.add_request([7] * 250, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    none = engine.add_request([7] * 253, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    short = engine.add_request([8], SamplingParams(temperature=0, max_tokens=2))
    done = run(engine)
    assert done[long].finish_reason == "length" and done[long].token_ids == [20, 21, 22, 23, 23, 23]
    assert done[none].finish_reason == "length" and len(done[none].token_ids) == 3
    assert done[short].token_ids == [30, 31] and done[short].finish_reason == "length"


def test_sampling_takes_the_full_path_only_while_a_request_needs_it(model_dir):
    """Plain greedy batches ask the runner for the argmax (the TP ranks pick the tokens, no logits reach the
    sampler); a request with logprobs or min_tokens sends the whole batch through sample() while it lives,
    and the tokens are the same either way."""
    engine = make_engine(model_dir, {7: [20, 21, 22, 23], 8: [30, 31, 32, 33], 9: [40, 41, 42, 43]})
    calls: list[str] = []
    sample, sample_greedy = engine.sampler.sample, engine.sampler.sample_greedy
    engine.sampler.sample = lambda logits, rows: calls.append("full") or sample(logits, rows)
    engine.sampler.sample_greedy = lambda logits: calls.append("greedy") or sample_greedy(logits)
    argmax_plans = engine.runner.argmax_plans

    a = engine.add_request([7], SamplingParams(temperature=0, max_tokens=4))
    done = run(engine)
    assert done[a].token_ids == [20, 21, 22, 23] and not calls and argmax_plans and all(argmax_plans)

    calls.clear()
    argmax_plans.clear()
    b = engine.add_request([7], SamplingParams(temperature=0, max_tokens=4))
    c = engine.add_request([8], SamplingParams(temperature=0, max_tokens=2, logprobs=1))
    d = engine.add_request([9], SamplingParams(temperature=0, max_tokens=4, min_tokens=1))
    done = run(engine)
    assert done[b].token_ids == [20, 21, 22, 23] and done[c].token_ids == [30, 31]
    assert done[d].token_ids == [40, 41, 42, 43]
    assert len(done[c].logprobs) == 2 and done[b].logprobs is None
    assert set(calls) == {"full"} and not any(argmax_plans)  # d lives as long as b: every step needed the rows

    calls.clear()
    argmax_plans.clear()
    e = engine.add_request([8], SamplingParams(temperature=0, max_tokens=3))
    assert run(engine)[e].token_ids == [30, 31, 32] and not calls and all(argmax_plans)  # finished: no trace


def test_generation_config_sampling_settings_are_the_defaults_of_requests(model_dir, tmp_path):
    qwen3 = with_generation_config(model_dir, tmp_path / "qwen3", temperature=0.6, top_p=0.95, top_k=20,
                                    do_sample=True, max_new_tokens=7)
    info = make_engine(qwen3, {}).model_info
    assert info.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    p = info.default_params(temperature=0.2, max_tokens=3)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.95, 20, 3)
    assert info.default_params().max_tokens == 7  # HF's max_new_tokens is the default max_tokens
    # Greedy by default: a request without params is decoded by argmax (the greedy fast path), as with
    # explicit temperature 0; with generation_config: none the default is temperature 1.0 (sampled).
    greedy = with_generation_config(model_dir, tmp_path / "greedy", temperature=0.0)
    for folder, mode, argmax in ((greedy, "auto", True), (greedy, "none", False), (model_dir, "auto", False)):
        config = RtpConfig(parallel=ParallelConfig(device="cpu"), model=ModelConfig(generation_config=mode),
                           scheduler=SchedulerConfig(max_num_seqs=8))
        engine = Engine(config, ScriptedRunner({5: [7, 8, 9]}), folder)
        engine.add_request([5, 6])
        run(engine)
        assert set(engine.runner.argmax_plans) == {argmax}, (folder.name, mode)


def test_a_bad_generation_config_value_fails_at_start_naming_the_file(model_dir, tmp_path):
    bad = with_generation_config(model_dir, tmp_path / "bad", top_p=1.5)
    with pytest.raises(ConfigError, match=r"generation_config.json.*top_p"):
        make_engine(bad, {})
    assert sampling_defaults_of({"eos_token_id": 3}, tmp_path / GENERATION_CONFIG) == {}  # none recommended
    bare = with_generation_config(model_dir, tmp_path / "bare")
    (bare / GENERATION_CONFIG).unlink()
    assert ModelInfo.load(bare, VOCAB, 64, generation_config="auto").sampling_defaults == {}  # no file: no defaults


def test_a_checkpoint_without_tokenizer_files_is_refused_at_load(tmp_path):
    folder = tmp_path / "notok"
    shutil.copytree(default_model_dir(), folder, ignore=shutil.ignore_patterns("tokenizer*"))
    assert ModelInfo.load(default_model_dir(), 4096, 64).tokenizer.encode("a b", add_special_tokens=False)
    with pytest.raises(ConfigError, match="notok has no usable tokenizer"):
        ModelInfo.load(folder, 4096, 64)


def test_outputs_text_is_current_at_every_step_and_a_plain_str_once_finished(model_dir):
    """The engine's outputs read their text from the detokenizer while a request runs: at every step ``text`` is
    the deltas so far (sample 0's in the flat fields for n > 1) and equals a one-shot decode at the end, where it
    is a str of its own (the output pickles without the detokenizer)."""
    import copy
    import pickle

    engine = make_engine(model_dir, {})
    tok = engine.tokenizer
    ids = tok.encode(" the cat sat on the mat, and then the dog sat on the cat", add_special_tokens=False)
    engine.runner.script = {7: ids}
    stop = tok.decode(ids[8:10])
    rids = [engine.add_request([7], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)),
            engine.add_request([7], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, stop=[stop])),
            engine.add_request([7], SamplingParams(temperature=0.5, seed=1, n=2, max_tokens=6, ignore_eos=True))]
    seen = dict.fromkeys(rids, "")
    finals, copies = {}, []
    for _ in range(200):
        for out in engine.step():
            seen[out.request_id] += out.new_text
            assert out.text == seen[out.request_id]
            if out.samples is not None:
                assert out.text == out.samples[0].text
            if out.finished:
                finals[out.request_id] = pickle.loads(pickle.dumps(out))
            elif out.text:  # a live output copies, deep-copies and pickles with its text as it reads now
                assert len(pickle.dumps(out)) < 10_000, "the detokenizer (and its tokenizer) went along"
                copies.append((out.text, copy.copy(out), copy.deepcopy(out), pickle.loads(pickle.dumps(out))))
        if not engine.has_unfinished():
            break
    assert copies and all(c.text == d.text == p.text == text for text, c, d, p in copies)
    plain, cut, multi = (finals[r] for r in rids)
    assert plain.text == tok.decode(ids) and len(pickle.dumps(plain)) < 10_000
    assert cut.text == tok.decode(ids).split(stop)[0] and cut.finish_reason == "stop"
    assert [c.text for c in multi.outputs] == [tok.decode(c.token_ids) for c in multi.outputs]


def _stream_requests(model_dir):
    """An engine with requests for the stream tests: n = 1 and 2, logprobs, a stop string, max_tokens, and a
    request to abort at step 4 (the last id)."""
    engine = make_engine(model_dir, {})
    tok = engine.tokenizer
    ids = tok.encode(" the cat sat on the mat, and then the dog sat on the cat", add_special_tokens=False)
    engine.runner.script = {7: ids}
    stop = tok.decode(ids[8:10])
    kw = dict(max_tokens=len(ids), ignore_eos=True)
    rids = [engine.add_request([7], SamplingParams(temperature=0, **kw)),
            engine.add_request([7], SamplingParams(temperature=0, stop=[stop], logprobs=2, **kw)),
            engine.add_request([7], SamplingParams(temperature=0.5, seed=1, n=2, logprobs=1, **kw)),
            engine.add_request([7], SamplingParams(temperature=0.5, seed=2, n=2, max_tokens=3, stop=[stop])),
            engine.add_request([7], SamplingParams(temperature=0, **kw))]
    return engine, ids, stop, rids


def test_a_stream_built_from_the_steps_deltas_equals_the_snapshots(model_dir):
    """The server's streams get each step's delta only (rtp.outputs.delta) and build the output from them
    (merge): at every step the built output equals a whole copy (snapshot) of the engine's, for n = 1 and 2,
    logprobs, a stop string, max_tokens and an abort; once finished its texts are plain strs."""
    engine, ids, stop, rids = _stream_requests(model_dir)
    tok = engine.tokenizer
    built: dict[str, RequestOutput] = {}
    steps = 0
    for steps in range(1, 200):
        for out in engine.step():
            got = built[out.request_id] = merge(built.get(out.request_id), delta(out))
            want = snapshot(out)
            assert got == want and got.outputs == want.outputs, (steps, out.request_id)
            if got.samples is not None:
                assert got.token_ids is got.samples[0].token_ids and got.text == got.samples[0].text
        if steps == 4:
            engine.abort(rids[4])
        if not engine.has_unfinished():
            break
    assert set(built) == set(rids) and all(o.finished for o in built.values()) and steps > 5
    assert built[rids[4]].finish_reason == "abort" and 0 < len(built[rids[4]].token_ids) < len(ids)
    assert built[rids[1]].finish_reason == "stop" and built[rids[0]].text == tok.decode(ids)
    for out in built.values():
        assert all(type(c.__dict__["_text"]) is str for c in [out, *(out.samples or ())])


@pytest.mark.parametrize("every", [2, 3])
def test_a_stream_that_fell_behind_takes_the_waiting_steps_as_one(model_dir, every):
    """A stream read once every ``every`` steps joins the deltas waiting for it (join_deltas) into one update:
    the built output equals the engine's at the last of them, and its new_token_ids / new_text (each sample's
    too) hold what all of them added."""
    engine, _, _, rids = _stream_requests(model_dir)
    live: dict[str, RequestOutput] = {}
    waiting: dict[str, list[RequestOutput]] = {}
    built: dict[str, RequestOutput] = {}
    joins = 0

    def read(rid: str) -> None:
        before = built.get(rid)
        lengths = [(0, 0)] * len(live[rid].outputs) if before is None else [
            (len(c.token_ids), len(c.text)) for c in before.outputs]
        got = built[rid] = merge(before, join_deltas(waiting.pop(rid)))
        want = snapshot(live[rid])
        for g, w, (n_tokens, n_chars) in zip(got.outputs, want.outputs, lengths, strict=True):
            assert (g.token_ids, g.text, g.logprobs, g.finish_reason, g.stop_reason) == (
                w.token_ids, w.text, w.logprobs, w.finish_reason, w.stop_reason), rid
            assert g.new_token_ids == w.token_ids[n_tokens:] and g.new_text == w.text[n_chars:], rid
        assert (got.token_ids, got.text, got.finished) == (want.token_ids, want.text, want.finished)

    for steps in range(1, 200):
        for out in engine.step():
            live[out.request_id] = out
            joins += out.request_id in waiting
            waiting.setdefault(out.request_id, []).append(delta(out))
        if steps == 4:
            engine.abort(rids[4])
        if steps % every == 0 or not engine.has_unfinished():
            for rid in list(waiting):
                read(rid)
        if not engine.has_unfinished():
            break
    assert set(built) == set(rids) and all(o.finished for o in built.values()) and joins > 5
