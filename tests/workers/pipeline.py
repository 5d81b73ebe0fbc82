"""Run under torchrun with pipeline stages: ``pipeline.py CONFIG PROMPTS_JSON OUT_JSON [features]``.

Writes to OUT_JSON: the greedy tokens of every prompt (one batch: chunked prefill, and a small
cache makes preemption happen), the scheduler's preemption count, the steps submitted while another
was in flight, the longest prompt's tokens reversed, alone (and those steps for it) and, with
``features``, what the
test compares with HF or with an invariant: greedy with a repetition penalty, prompt logprobs and
logprobs, n = 2 seeded samples next to the n = 1 requests with the same seeds, a choice grammar.
"""

import json
import sys

import rtp
from rtp.structured import GrammarCompiler, GrammarSpec

config, prompts_file, out_file = sys.argv[1:4]
features = len(sys.argv) > 4
prompts = json.loads(open(prompts_file).read())
runtime = rtp.init(config, log_level="WARNING")
greedy = rtp.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
result: dict = {"tokens": [o.token_ids for o in rtp.generate(prompts, greedy, use_tqdm=False)]}
result["preemptions"] = runtime.engine.stats()["num_preemptions"]
result["overlapped"] = runtime.engine.stats().get("pipeline_overlapped_steps", 0)
# The longest prompt reversed (no prefix-cache hit) alone: its prefill chunks follow one another through
# the stages.
result["alone"] = rtp.generate([prompts[-1][::-1]], greedy, use_tqdm=False)[0].token_ids
result["alone_overlapped"] = runtime.engine.stats().get("pipeline_overlapped_steps", 0) - result["overlapped"]
if features:
    p0, p1 = prompts[1], prompts[2]
    rep = rtp.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5)
    lp = rtp.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    sampled = rtp.SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, seed=7, n=2,
                                 presence_penalty=0.5, frequency_penalty=0.3)
    single = [rtp.SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, seed=s,
                                 presence_penalty=0.5, frequency_penalty=0.3) for s in (7, 8)]
    info = runtime.model_info
    compiler = GrammarCompiler(info.tokenizer, info.vocab_size, list(info.eos_token_ids))
    spec = GrammarSpec.choice(["yes", "no", "maybe so"], "choice")
    choice = rtp.SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                constraint=compiler.constraint_factory(compiler.compile(spec), spec))
    outs = rtp.generate([p0, p1, p0, p0, p0, p1], [rep, lp, sampled, single[0], single[1], choice], use_tqdm=False)
    result["repetition"] = outs[0].token_ids
    result["prompt_logprobs"] = [None if d is None else {str(k): v for k, v in d.items()}
                                 for d in outs[1].prompt_logprobs]
    result["logprobs"] = [{str(k): v for k, v in d.items()} for d in outs[1].logprobs]
    result["lp_tokens"] = outs[1].token_ids
    result["n2"] = [s.token_ids for s in outs[2].samples]
    result["n1"] = [outs[3].token_ids, outs[4].token_ids]
    result["choice"] = outs[5].text
rtp.shutdown()
open(out_file, "w").write(json.dumps(result))
