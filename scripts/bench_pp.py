"""Pipeline parallelism on CPU: the gain of steps in flight, and what crosses a stage boundary vs TP's all-reduces.

    python scripts/bench_pp.py                 # the 40M Qwen3 shape of scripts/bench.py, 16 requests
    python scripts/bench_pp.py --quick         # a smaller model and workload (a smoke run)
    python scripts/bench_pp.py --partition 6,2 --tp1   # stages balanced for the LM head; also one rank
    python scripts/bench_pp.py --workload prefill       # long prompts: chunked prefill keeps both stages busy
    python scripts/bench_pp.py --workload prefill --num-requests 1 --prompt-len 2048 --partition 3,5
                                                        # one long prompt: its chunks pipeline

Three runs, one after the other, each a torchrun of its own (one thread per rank), on the same
checkpoint and requests, greedy with EOS ignored:

* PP=2 with steps in flight (``pipeline_steps_in_flight`` unset: 2, each over half the requests);
* PP=2 one step at a time (``pipeline_steps_in_flight: 1``): while one stage computes, the other waits;
* TP=4, for its bytes only (4 ranks on a 2-core machine: its time means nothing here).

It prints the generate() time (best of ``--repeat``) of both PP runs and their ratio (the
pipelining gain; > 1 means steps in flight are faster), checks that the PP runs give the same
tokens (and one rank's, with ``--tp1``), and, per decode step (a step with no prompt token),
the bytes that cross the stage boundary at PP=2 (the hidden states rank 0 sends to stage 1,
measured; plus the final hidden states of the sampled rows the last stage returns to rank 0,
which holds the LM head) against the bytes each TP=4 rank all-reduces (measured at every
``ParallelState.all_reduce`` call; a ring all-reduce puts about 2 (TP-1)/TP of that on each
rank's link) and the logits it gathers. Rank 0's stage also runs the LM head and the engine:
give it fewer layers (``--partition 3,5`` for the default model) or it is the slower stage.
Absolute times on a shared machine mean little: compare the ratio of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=32000)
QUICK_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096)


def build_model(quick: bool) -> str:
    from bench import cached_model

    from rtp.testing import TinyQwen3Spec

    return cached_model("bench-pp", TinyQwen3Spec(**(QUICK_SHAPE if quick else SHAPE)))


def workload(n: int, vocab: int, quick: bool, kind: str = "decode",
             prompt_len: int | None = None) -> list[tuple[list[int], int]]:
    """``n`` (prompt, output length) pairs: decode-heavy (short prompts, 48 tokens out) or prefill-heavy
    (long prompts, 2 tokens out: chunked prefill of several prompts at once); ``prompt_len`` fixes the
    prompt length."""
    rng = random.Random(0)
    if kind == "prefill":
        lo, hi, out = (64, 128, 2) if quick else (192, 320, 2)
    else:
        lo, hi, out = (8, 32, 16) if quick else (32, 96, 48)
    if prompt_len is not None:
        lo = hi = prompt_len
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], out) for _ in range(n)]


# --------------------------------------------------------------------------- child (every rank runs it)


def child(args: argparse.Namespace) -> None:
    import rtp

    reqs = json.loads(Path(args.requests).read_text())
    overrides: dict = dict(model=args.model, device="cpu", dtype="float32", log_level="WARNING",
                           enable_prefix_caching=False, max_num_seqs=256, enforce_eager=True,
                           max_num_batched_tokens=args.max_num_batched_tokens)
    if args.pp > 1:
        overrides.update(pipeline_parallel_size=args.pp, pipeline_steps_in_flight=args.in_flight,
                         pipeline_layer_partition=args.partition)
    rt = rtp.init(None, **overrides)
    # Worker ranks never get here. Count rank 0's bytes in decode steps: what it sends to the next stage, what
    # it all-reduces and what its logits gather receives (every TP rank all-reduces the same amount).
    runner, ps = rt.engine.runner, rt.engine.runner.ps
    counts = dict(decode_steps=0, decode_rows=0, boundary=0, allreduce=0, gather=0)
    total = dict(allreduce=0, gather=0)
    all_reduce, gather, submit = ps.all_reduce, ps.gather_to_driver, runner.submit

    def counting_all_reduce(x):  # noqa: ANN001, ANN202
        total["allreduce"] += x.numel() * x.element_size()
        return all_reduce(x)

    def counting_gather(x, dim=-1):  # noqa: ANN001, ANN202
        total["gather"] += x.numel() * x.element_size() * (ps.tp_size - 1)  # the other ranks' parts
        return gather(x, dim)

    def counting_submit(plan):  # noqa: ANN001, ANN202
        decode = not plan.new_seqs and all(n == 1 for n in plan.cached_seqs.num_new_tokens)
        before = (runner.link.bytes_sent if runner.link else 0, total["allreduce"], total["gather"])
        out = submit(plan)
        if decode and plan.cached_seqs.seq_ids:
            counts["decode_steps"] += 1
            counts["decode_rows"] += len(plan.cached_seqs.seq_ids)
            counts["boundary"] += (runner.link.bytes_sent if runner.link else 0) - before[0]
            counts["allreduce"] += total["allreduce"] - before[1]
            counts["gather"] += total["gather"] - before[2]
        return out

    ps.all_reduce, ps.gather_to_driver, runner.submit = counting_all_reduce, counting_gather, counting_submit
    params = [rtp.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    prompts = [p for p, _ in reqs]
    warm = prompts[:4]
    rtp.generate(warm, [rtp.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * len(warm),
                 use_tqdm=False)  # warm-up
    for k in counts:
        counts[k] = 0
    seconds = float("inf")
    for _ in range(args.repeat):  # the best of a few runs: the machine is shared
        t0 = time.perf_counter()
        outs = rtp.generate(prompts, params, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - t0)
    overlapped = rt.engine.stats().get("pipeline_overlapped_steps", 0)
    rtp.shutdown()
    Path(args.result).write_text(json.dumps(dict(
        seconds=seconds, tokens=sum(len(o.token_ids) for o in outs), outputs=[list(o.token_ids) for o in outs],
        overlapped=overlapped, vocab=runner.spec.vocab_size, hidden=runner.spec.hidden_size, **counts)))


# --------------------------------------------------------------------------- parent


def run(name: str, nproc: int, args: argparse.Namespace, requests: Path, *extra: str) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--child", "--model", args.model, "--requests", str(requests),
           "--result", str(result), "--repeat", str(args.repeat),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    try:
        if proc.returncode != 0:
            print(f"{name}: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            return None
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def per_step(res: dict, key: str) -> float:
    return res[key] / max(1, res["decode_steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF Qwen3 folder (default: a random 40M Qwen3, built on first use)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--workload", choices=["decode", "prefill"], default="decode",
                    help="decode: short prompts, 48 tokens out; prefill: 192-320-token prompts, 2 tokens out")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="query tokens per step")
    ap.add_argument("--prompt-len", type=int, help="every prompt this long (default: the workload's mix)")
    ap.add_argument("--quick", action="store_true", help="a smaller model and shorter requests")
    ap.add_argument("--no-tp", action="store_true", help="skip the TP=4 run (its bytes)")
    ap.add_argument("--partition", help="pipeline_layer_partition of the PP runs, e.g. 6,2 (default: even split)")
    ap.add_argument("--repeat", type=int, default=3, help="timed generate() runs per engine (the best counts)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--wait-quiet", type=float, default=120.0, help="max seconds to wait for an idle machine")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--requests", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--in-flight", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp1", action="store_true", help="also one rank, no stages (the time PP=2 is split from)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import cpu_busy_fraction, wait_quiet

    args.model = args.model or build_model(args.quick)

    wait_quiet(args.wait_quiet)
    print(f"machine busy before the runs: {cpu_busy_fraction():.0%} of {os.cpu_count()} cores")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.json"
        reqs = workload(args.num_requests, min(vocab, 4000), args.quick, args.workload, args.prompt_len)
        requests.write_text(json.dumps(reqs))
        print(f"{len(reqs)} requests, prompts {min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)} tokens, "
              f"{reqs[0][1]} output tokens each; model {args.model}")
        part = ["--partition", args.partition] if args.partition else []
        flight = run("PP=2 in flight", 2, args, requests, "--pp", "2", *part)
        single = run("PP=2 one at a time", 2, args, requests, "--pp", "2", "--in-flight", "1", *part)
        one = run("one rank", 1, args, requests) if args.tp1 else None
        tp = None if args.no_tp else run("TP=4", 4, args, requests)
    if flight is None or single is None:
        sys.exit(1)
    for name, res in (("PP=2, steps in flight", flight), ("PP=2, one step at a time", single)):
        print(f"{name:26s} generate {res['seconds']:7.2f} s  {res['tokens'] / res['seconds']:7.1f} tok/s  "
              f"({res['overlapped']} steps overlapped)")
    if one is not None:
        print(f"{'one rank (TP=1, PP=1)':26s} generate {one['seconds']:7.2f} s  "
              f"{one['tokens'] / one['seconds']:7.1f} tok/s")
    print(f"pipelining gain: {single['seconds'] / flight['seconds']:.2f}x (one at a time / in flight)")
    # PP adds no arithmetic of its own: its runs equal one rank token for token. TP=4 sums the all-reduced
    # partial products in another order, so on random weights a near-tie may flip a token: shown, not checked.
    runs = {"PP=2 one at a time": single, "one rank": one}
    diff = [name for name, res in runs.items() if res is not None and res["outputs"] != flight["outputs"]]
    same = not diff
    print(f"greedy outputs equal across the PP runs and one rank: {same}" + (f" (differ: {diff})" if diff else ""))
    if tp is not None:
        print(f"TP=4 greedy outputs equal to PP=2's: {tp['outputs'] == flight['outputs']}")
    rows = per_step(single, "decode_rows")
    print(f"per decode step ({rows:.1f} sequences on average, one step at a time):")
    print(f"  PP=2 stage boundary, hidden states (measured): {per_step(single, 'boundary'):10.0f} B "
          f"({per_step(single, 'boundary') / rows:.0f} B per sequence)")
    print(f"  PP=2 final hidden rows back to rank 0:         {rows * single['hidden'] * 4:10.0f} B "
          f"(logits rows would be {rows * single['vocab'] * 4:.0f} B)")
    if tp is not None:
        ar, ga, tp_rows = per_step(tp, "allreduce"), per_step(tp, "gather"), per_step(tp, "decode_rows")
        print(f"  TP=4 all-reduce payload per rank (measured):   {ar:10.0f} B "
              f"({ar / tp_rows:.0f} B per sequence; ring: ~{ar * 1.5:.0f} B on each rank's link)")
        print(f"  TP=4 logits gather to rank 0 (measured):       {ga:10.0f} B")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
