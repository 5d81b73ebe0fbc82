"""One rank, no torchrun: greedy generation with kv_cache_dtype auto, then fp8_e4m3 (fp32 compute), each twice (the
second time from the prefix cache); writes each run's tokens, KV block count and prefix-cache hits."""

import json
import sys

import rtp


def main() -> None:
    model, prompts_path, out_path = sys.argv[1:4]
    prompts = json.loads(open(prompts_path).read())
    params = rtp.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    result = {}
    for kv in ("auto", "fp8_e4m3"):
        rt = rtp.init(None, model={"path": model}, device="cpu", dtype="float32", kv_cache_dtype=kv,
                      cpu_kv_cache_gib=0.01, log_level="WARNING")
        outs = rtp.generate(prompts, params, use_tqdm=False)
        result[kv] = {"tokens": [o.token_ids for o in outs], "num_blocks": rt.engine.stats()["num_blocks"]}
        # The same prompts again: their full blocks come from the prefix cache.
        hits = rt.engine.stats()["prefix_hit_tokens"]
        again = rtp.generate(prompts, params, use_tqdm=False)
        result[kv] |= {"again": [o.token_ids for o in again], "hits": rt.engine.stats()["prefix_hit_tokens"] - hits}
        rtp.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
