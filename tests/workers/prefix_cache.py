"""Run under torchrun: two batches sharing a long prefix; rank 0 writes outputs and counters."""

import json
import sys

import rtp


def main() -> None:
    config, prompts_path, out_path = sys.argv[1:4]
    batches = json.loads(open(prompts_path).read())
    rt = rtp.init(config)
    params = rtp.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    result = []
    for batch in batches:
        before = rt.engine.stats()
        outs = rtp.generate(batch, params, use_tqdm=False)
        after = rt.engine.stats()
        result.append({
            "tokens": [o.token_ids for o in outs],
            "computed": after["num_prefill_tokens_computed"] - before["num_prefill_tokens_computed"],
            "hits": after["prefix_hit_tokens"] - before["prefix_hit_tokens"],
            "cached": [o.num_cached_tokens for o in outs],
        })
    rtp.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
