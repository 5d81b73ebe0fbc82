"""Run under torchrun: greedy generation with speculative decoding; rank 0 writes the outputs and counters."""

import json
import sys

import rtp


def main() -> None:
    config, prompts_path, out_path = sys.argv[1:4]
    prompts = json.loads(open(prompts_path).read())
    rt = rtp.init(config)
    params = rtp.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = rtp.generate(prompts, params, use_tqdm=False)
    stats = rt.engine.stats()
    rtp.shutdown()
    with open(out_path, "w") as f:
        json.dump({"tokens": [o.token_ids for o in outs], "stats": stats}, f)


if __name__ == "__main__":
    main()
