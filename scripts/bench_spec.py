"""Speculative decoding against none, in one process: the ratio of their tokens/s, run by run.

``scripts/bench.py --speculative-config`` times each engine once, in its own process; on a shared
2-core host two such runs a minute apart can differ by 30%, more than the effect measured. This
script builds one engine per setting in the same process (rank 0 only, TP = 1, the same model,
cache and scheduler settings) and times the same requests on each in turn, A B A B ..., so each
pair of runs sees the same machine. It prints every engine's median time, tokens per step and
acceptance, and the median and range of the per-pair ratios of each speculative setting to "off".
Outputs must equal "off" token for token (greedy), else it exits 1.

Besides the whole run it times parts of a step: the model's forward pass (``execute``, a
verification step where there are drafts), the proposer's drafting (``propose``) and what it takes
from each step's output (``observe``: an EAGLE-3 head's features).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_spec.py                      # shipped model and head
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_spec.py --spec ngram:4 --spec eagle3:3 --spec eagle3:4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from rtp.assets import trained_eagle3_dir, trained_model_dir
from rtp.config import RtpConfig
from rtp.config.sections import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from rtp.distributed.parallel import ParallelState
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import ModelRunner
from rtp.sampling import SamplingParams


class Timed:
    """Wraps one method of an object and adds its wall time to ``totals[key]``."""

    def __init__(self, obj: object, name: str, key: str, totals: dict[str, float]) -> None:
        inner = getattr(obj, name)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t0

        setattr(obj, name, timed)


def spec_config(text: str, head: Path, draft: str | None) -> SpeculativeConfig:
    """``method:k`` (ngram, eagle3, draft_model) -> the speculative config."""
    method, _, k = text.partition(":")
    model = {"eagle3": str(head), "draft_model": draft}.get(method)
    if method == "draft_model" and draft is None:
        sys.exit("--spec draft_model:K needs --draft")
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=int(k or 4))


def make_engine(model: Path, spec: SpeculativeConfig | None, args: argparse.Namespace) -> Engine:
    config = RtpConfig(
        model=ModelConfig(dtype=args.dtype), parallel=ParallelConfig(device="cpu"),
        cache=CacheConfig(block_size=16, num_kv_blocks=4096, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(16, args.batch)), speculative_config=spec or SpeculativeConfig(),
    )
    return Engine(config, ModelRunner(ParallelState.single("cpu"), model, config), model)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]], int]:
    """(seconds, outputs, engine steps) of the prompts, all submitted at once."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return time.perf_counter() - t0, [done[i] for i in ids], steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=trained_model_dir(), help="target (default: the shipped model)")
    ap.add_argument("--head", type=Path, default=trained_eagle3_dir(), help="EAGLE-3 head (default: the shipped one)")
    ap.add_argument("--draft", help="draft model folder, for --spec draft_model:K")
    ap.add_argument("--spec", action="append", help="method:k, repeatable (default: ngram:4 and eagle3:4)")
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=248)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=7, help="timed runs of each engine (after one warm-up)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = int(__import__("json").loads((args.model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)  # random token prompts, as scripts/bench.py's workload
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    names = ["off", *(args.spec or ["ngram:4", "eagle3:4"])]
    engines: dict[str, Engine] = {}
    parts: dict[str, dict[str, float]] = {}
    for name in names:
        spec = None if name == "off" else spec_config(name, args.head, args.draft)
        engine = engines[name] = make_engine(args.model, spec, args)
        totals = parts[name] = defaultdict(float)
        Timed(engine.runner, "execute", "execute", totals)
        if engine.spec is not None:
            Timed(engine.spec, "propose", "propose", totals)
            Timed(engine.spec, "observe", "observe", totals)
    times: dict[str, list[float]] = defaultdict(list)
    steps: dict[str, int] = {}
    reference: list[list[int]] | None = None
    for r in range(args.rounds + 1):
        for name, engine in engines.items():
            if r == 1:  # the warm-up round is not counted
                parts[name].clear()
            before = engine.stats()
            seconds, outs, steps[name] = run(engine, prompts, params)
            if r > 0:
                times[name].append(seconds)
            if reference is None:
                reference = outs
            elif outs != reference:
                sys.exit(f"{name}: outputs differ from off's")
            after = engine.stats()
            if r == args.rounds and engine.spec is not None:
                drafts = after["spec_num_drafts"] - before.get("spec_num_drafts", 0)
                accepted = after["spec_num_accepted_tokens"] - before.get("spec_num_accepted_tokens", 0)
                parts[name]["acceptance_length"] = 1 + accepted / max(1, drafts)

    tokens = args.batch * args.output_len
    print(f"batch {args.batch}, prompt {args.prompt_len}, output {args.output_len} tokens, {args.dtype}, "
          f"{args.threads} thread(s), {args.rounds} alternated rounds; outputs equal off's")
    base = times["off"]
    for name in names:
        med = statistics.median(times[name])
        p = parts[name]
        per_step = {k: v / args.rounds / steps[name] * 1e3 for k, v in p.items()
                    if k in ("execute", "propose", "observe")}
        line = (f"{name:>14}: {med * 1e3:7.1f} ms  {tokens / med:7.1f} tok/s  {steps[name]:4d} steps  "
                + "  ".join(f"{k} {v:.2f} ms/step" for k, v in per_step.items()))
        if "acceptance_length" in p:
            line += f"  acceptance length {p['acceptance_length']:.2f}"
        if name != "off":
            ratios = sorted(b / t for b, t in zip(base, times[name]))
            line += f"  vs off: {statistics.median(ratios):.2f}x (pairs {ratios[0]:.2f}-{ratios[-1]:.2f})"
        print(line)


if __name__ == "__main__":
    main()
