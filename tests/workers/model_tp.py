"""Run under torchrun: rtp's forward pass and paged greedy decoding on every model given.

Every rank builds the same StepPlans locally (no scheduler), so this checks the
model, the loader and the paged attention in isolation. Rank 0 saves the
final-token logits of each prompt and 32 greedy tokens to ``--out``.
"""

import argparse
import json
import sys

import torch

from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig
from rtp.core.step import CachedSeq, NewSeq, StepPlan
from rtp.distributed.parallel import ParallelState
from rtp.runtime.model_runner import ModelRunner

BLOCK = 4


def mixed_start(runner: ModelRunner, ps: ParallelState, n: int, logits, tokens: list[list[int]]):  # noqa: ANN001
    """Prompt 0's last prefill chunk in the same step as the first decode of prompts 1..n-1.

    Then one decode step of prompt 0 alone, so every prompt has two tokens. Returns the
    final-token logits of the prompts in prompt order (rank 0).
    """
    first_ids = ps.broadcast_object([int(r.argmax()) for r in logits] if ps.rank == 0 else None)
    rest = [CachedSeq(i, 1, [first_ids[i - 1]], []) for i in range(1, n)]
    plan = StepPlan(cached_seqs=[CachedSeq(0, 3, [], []), *rest])
    second = runner.execute(plan).sample_logits  # rows: prompt 0, 1..n-1
    tok0 = ps.broadcast_object(int(second[0].argmax()) if ps.rank == 0 else None)
    third = runner.execute(StepPlan(cached_seqs=[CachedSeq(0, 1, [tok0], [])])).sample_logits
    if ps.rank != 0:
        return None
    tokens[0] += [tok0, int(third[0].argmax())]
    for i in range(1, n):
        tokens[i] += [first_ids[i - 1], int(second[i].argmax())]
    return torch.cat([second[:1], logits])


def run_model(
    ps: ParallelState, model_dir: str, prompts: list[list[int]], steps: int, expert_parallel: bool = False,
    mixed: bool = False, dtype: str = "float32", quantization: str | None = None,
) -> dict:
    config = RtpConfig(model=ModelConfig(dtype=dtype, enforce_eager=True, quantization=quantization),
                       parallel=ParallelConfig(expert_parallel=expert_parallel),
                       cache=CacheConfig(block_size=BLOCK, num_kv_blocks=512))
    runner = ModelRunner(ps, model_dir, config)
    # Each sequence gets its own blocks, in reverse order so the block table is not the identity.
    tables, next_block = [], 511
    for p in prompts:
        n = -(-(len(p) + steps) // BLOCK)
        tables.append(list(range(next_block, next_block - n, -1)))
        next_block -= n
    # Step 1: every prompt in full except prompt 0, whose last 3 tokens come in a second
    # chunk: that exercises attention over a cached prefix.
    first = StepPlan(
        new_seqs=[NewSeq(i, p, tables[i], 0, len(p) - (3 if i == 0 else 0)) for i, p in enumerate(prompts)]
    )
    logits = runner.execute(first).sample_logits
    tokens = [[] for _ in prompts]
    if mixed:
        last, have = mixed_start(runner, ps, len(prompts), logits, tokens), 2
    else:
        second = runner.execute(StepPlan(cached_seqs=[CachedSeq(0, 3, [], [])])).sample_logits
        have = 1
        if ps.rank == 0:
            last = torch.cat([second, logits])  # row order: prompt 0, then prompts 1..n
            for i in range(len(prompts)):
                tokens[i].append(int(last[i].argmax()))
    for step in range(steps - have):
        next_ids = ps.broadcast_object([t[-1] for t in tokens] if ps.rank == 0 else None)
        # Every other step asks for the argmax instead of the logits: the ranks pick the tokens from their
        # vocabulary shards (the tokens are compared with HF's greedy ones like the rest).
        argmax = step % 2 == 1
        plan = StepPlan(cached_seqs=[CachedSeq(i, 1, [next_ids[i]], []) for i in range(len(prompts))],
                        sample_argmax=argmax)
        out = runner.execute(plan)
        if ps.rank == 0:
            assert (out.sample_logits is None) == argmax and (out.sample_tokens is None) != argmax
            for i in range(len(prompts)):
                tokens[i].append(int(out.sample_tokens[i]) if argmax else int(out.sample_logits[i].argmax()))
    result = {"tokens": tokens, "bytes_read": runner.load_report.bytes_read}
    if ps.rank == 0:
        result["logits"] = last
    reads = [None] * ps.world_size
    if ps.world_size > 1:
        torch.distributed.all_gather_object(reads, runner.load_report.bytes_read, group=ps.cpu_group)
    else:
        reads = [runner.load_report.bytes_read]
    result["bytes_read_per_rank"] = reads
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--expert-parallel", action="store_true", help="MoE models: whole experts per rank")
    ap.add_argument("--mixed", action="store_true",
                    help="run a prefill chunk and decode rows in one step (a mixed batch)")
    ap.add_argument("--ep-models", nargs="*", default=[],
                    help="MoE models run a second time with expert parallelism (saved as '<path>#ep'): one launch")
    ap.add_argument("--quantization", help="ModelConfig.quantization for every model (int8)")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    ps = ParallelState.from_env("cpu")
    prompts = json.loads(args.prompts)
    results = {m: run_model(ps, m, prompts, args.steps, args.expert_parallel, args.mixed,
                            quantization=args.quantization) for m in args.models}
    results |= {f"{m}#ep": run_model(ps, m, prompts, args.steps, True, args.mixed) for m in args.ep_models}
    if ps.rank == 0:
        torch.save(results, args.out)
    ps.destroy()


if __name__ == "__main__":
    sys.exit(main())
