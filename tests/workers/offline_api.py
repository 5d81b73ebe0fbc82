"""Run as a script (one rank): rtp.generate / generate_stream input forms and bookkeeping. Prints OK."""

import threading

import rtp
from rtp.errors import ConfigError, RequestError

greedy = rtp.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# A failed init (no room for the KV cache) leaves no thread behind, and init works after it.
try:
    rtp.init(None, log_level="WARNING", cpu_kv_cache_gib=1e-6)
    raise AssertionError("a KV cache without room for one block was accepted")
except ConfigError:
    pass
assert not [t for t in threading.enumerate() if t.name.startswith("rtp-")], threading.enumerate()
rtp.init(None, log_level="WARNING")

# One token-id list, one string, and a mixed list give the same outputs for the same prompts.
[single] = rtp.generate([5, 6, 7], greedy, use_tqdm=False)
[text] = rtp.generate("hello there", greedy, use_tqdm=False)
mixed = rtp.generate([[5, 6, 7], "hello there"], greedy, use_tqdm=False)
assert [o.token_ids for o in mixed] == [single.token_ids, text.token_ids]
# vLLM's offline forms: prompt dicts, a tuple of prompts, numpy ids.
import numpy as np  # noqa: E402

vllm_forms = rtp.generate(({"prompt_token_ids": np.array([5, 6, 7])}, {"prompt": "hello there"}), greedy,
                          use_tqdm=False)
assert [o.token_ids for o in vllm_forms] == [single.token_ids, text.token_ids]
assert rtp.generate({"prompt": "hello there"}, greedy, use_tqdm=False)[0].token_ids == text.token_ids
assert rtp.generate(np.array([5, 6, 7]), greedy, use_tqdm=False)[0].token_ids == single.token_ids
try:
    rtp.generate(["a", {"text": "b"}], greedy, use_tqdm=False)
    raise AssertionError("a dict without prompt or prompt_token_ids was accepted")
except RequestError as e:
    assert "prompt 1: a dict prompt holds one of 'prompt' (text) or 'prompt_token_ids'" in str(e), e
assert len(single.token_ids) == 6 and single.finish_reason == "length"

# Per-prompt params are applied in order.
outs = rtp.generate([[1, 2], [1, 2]], [rtp.SamplingParams(temperature=0, max_tokens=2),
                                       rtp.SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
assert [len(o.token_ids) for o in outs] == [2, 5]
assert outs[0].token_ids == outs[1].token_ids[:2]

# Bad inputs fail clearly and leave nothing queued behind for the next call.
for bad_call, words in [
    (lambda: rtp.generate([[1, 2]], [greedy, greedy], use_tqdm=False), "2 SamplingParams for 1 prompts"),
    (lambda: rtp.generate([[1, 2]], [{"temperature": 0}], use_tqdm=False), "expected rtp.SamplingParams"),
    (lambda: rtp.generate([[1, 2], [10**7]], greedy, use_tqdm=False), "prompt 1: token id"),
]:
    try:
        bad_call()
    except (RequestError, TypeError, ValueError) as e:
        assert words in str(e), (words, str(e))
    else:
        raise AssertionError(f"no error for {words}")
again = rtp.generate([[5, 6, 7]], greedy, use_tqdm=False)
assert again[0].token_ids == single.token_ids

# Streaming: distinct snapshots whose deltas add up, and an early close aborts the request.
chunks = list(rtp.generate_stream([5, 6, 7], greedy))
assert len({id(c) for c in chunks}) == len(chunks)
assert [t for c in chunks for t in c.new_token_ids] == single.token_ids
assert "".join(c.new_text for c in chunks) == chunks[-1].text == single.text
stream = rtp.generate_stream([5, 6, 7], rtp.SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
next(stream)
stream.close()
after = rtp.generate([[9, 9]], greedy, use_tqdm=False)
assert len(after) == 1 and after[0].finish_reason == "length"
assert rtp.generate([], greedy, use_tqdm=False) == []

# Calls that overlap share the engine's steps; each gets its own request's outputs, all of them. A generate()
# while a stream is open (its steps run the stream's request too, to its end), then two streams in lockstep.
stream = rtp.generate_stream([5, 6, 7], greedy)
first = next(stream)
[mid] = rtp.generate("hello there", greedy, use_tqdm=False)
rest = list(stream)
assert mid.token_ids == text.token_ids
assert [t for c in [first, *rest] for t in c.new_token_ids] == single.token_ids and rest[-1].finished
pairs = list(zip(rtp.generate_stream([5, 6, 7], greedy), rtp.generate_stream("hello there", greedy), strict=True))
for i, want in enumerate((single, text)):
    assert [t for pair in pairs for t in pair[i].new_token_ids] == want.token_ids and pairs[-1][i].finished

# Ctrl-C (SIGINT) during generate(): a KeyboardInterrupt the script may catch; its requests are aborted and the
# runtime goes on serving.
import os  # noqa: E402
import signal  # noqa: E402

long = rtp.SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
timer.start()
try:
    rtp.generate([[5, 6, 7]] * 256, long, use_tqdm=False)
    raise AssertionError("generate() was not interrupted")
except KeyboardInterrupt:
    pass
timer.join()
assert rtp.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].token_ids == single.token_ids

try:  # the same check as generate()'s, not an AttributeError from inside the engine
    next(rtp.generate_stream("a", "not params"))
    raise AssertionError("generate_stream took a string for its SamplingParams")
except TypeError as e:
    assert "expected rtp.SamplingParams" in str(e), e

# Once shut down, nothing holds the runtime (its KV cache): atexit kept every init()'s runtime alive before.
import gc  # noqa: E402
import weakref  # noqa: E402

runtime = weakref.ref(rtp._current)
rtp.shutdown()
gc.collect()
assert runtime() is None, gc.get_referrers(runtime())
rtp.init(None, log_level="WARNING")  # and a new one starts after it
assert rtp.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].token_ids == single.token_ids
rtp.shutdown()
print("OK")
