"""Engine overhead of one decode step, with a null model: everything a step costs except the forward.

Runs the real ``Engine.step`` (rtp/runtime/engine.py) of rank 0 around a null
runner, and times each stage of the step loop:

    schedule   Scheduler.schedule()                      (rank 0)
    encode     rtp.core.step.encode(plan)                (rank 0)
    write      ShmChannel.write                          (rank 0)
    read       ShmChannel.read                           (workers)
    decode     rtp.core.step.decode                      (workers)
    apply      BatchMirror.apply(decoded plan)           (every rank)
    to_device  ModelRunner.to_device on CPU tensors,     (every rank)
               plus the sample-index tensor of execute()
    sample     null sampler: a fixed non-EOS token       (rank 0)
    postproc   Scheduler.postprocess                     (rank 0)
    engine     the rest of Engine.step: inbox, sample    (rank 0)
               rows (only while a request is not plain
               greedy), per-token outputs, detokenizer
    detok      with --split-detok only: the detokenizer  (rank 0)
               calls, out of "engine" (each call then also
               pays ~0.5 us of timing wrapper, in detok and engine)

The reader end of the channel lives in this process and reads right after the
write, so ``read`` is the cost of copying a message out, not the cross-process
wake-up latency (scripts/bench_channel.py measures that). ``total`` is the
whole step, all stages in series: an upper bound of each rank's own path, since
rank 0 neither reads nor decodes and workers do not schedule.

Only steady-state decode steps are measured: every sequence is running with a
128-token prompt already computed, each step computes one token per sequence,
none finishes (max_tokens is out of reach, the sampled token is not EOS).
Garbage collection stays on, as in the runtime (--gc-freeze: frozen after start-up).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_engine.py
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_engine.py --seqs 256 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoTokenizer

from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.core.step import StepPlan, decode, encode
from rtp.distributed.shm_channel import ShmChannel
from rtp.distributed.shm_segment import make_segment_name
from rtp.runtime.batch import BatchMirror
from rtp.runtime.detokenizer import IncrementalDetokenizer
from rtp.runtime.engine import Engine
from rtp.runtime.model_runner import ModelRunner, StepOutput
from rtp.runtime.sampler import SamplerOutput, SampleRow
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir

STAGES = ("schedule", "encode", "write", "read", "decode", "apply", "to_device", "sample", "postproc", "detok",
          "engine")
_now = time.perf_counter_ns


class StepTimes:
    """Nanoseconds spent in each stage during the current step, and the record of every measured step."""

    def __init__(self) -> None:
        self.current: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.steps: list[dict[str, int]] = []

    def timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, with its run time added to ``stage``."""
        current = self.current

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                current[stage] += _now() - t0

        return wrapper

    def reset(self) -> None:
        for stage in STAGES:
            self.current[stage] = 0


class NullRunner:
    """Stands in for ModelRunner: the worker-side mirror and the real ``to_device`` on CPU, no forward."""

    def __init__(self, times: StepTimes, block_size: int, num_blocks: int, max_model_len: int, vocab: int) -> None:
        self.times = times
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.max_num_batched_tokens = 8192
        self.spec = SimpleNamespace(vocab_size=vocab)
        self.ps = SimpleNamespace(device=torch.device("cpu"))  # what ModelRunner.to_device reads
        self.mirror = BatchMirror(block_size)
        self.received: StepPlan | None = None  # the plan as the worker decoded it
        self.last_batch = None

    def execute(self, plan: StepPlan) -> StepOutput:
        """Apply the decoded plan and build the step's tensors; return [num_samples, 1] dummy logits."""
        received, self.received = self.received, None
        assert received is not None, "transport did not deliver the plan"
        cur = self.times.current
        t0 = _now()
        batch = self.mirror.apply(received)
        t1 = _now()
        ModelRunner.to_device(self, batch)  # type: ignore[arg-type]  # the real code, on CPU tensors
        sample_idx = torch.from_numpy(batch.sample_indices)  # as ModelRunner.execute does
        t2 = _now()
        cur["apply"] += t1 - t0
        cur["to_device"] += t2 - t1
        self.last_batch = batch
        return StepOutput(sample_logits=torch.empty(len(sample_idx), 1))


class FixedSampler:
    """Samples ``token`` for every row."""

    def __init__(self, token: int) -> None:
        self.token = token

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        return self._output(len(rows))

    def sample_greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """What the engine calls while every request is plain greedy (no SampleRow objects)."""
        return self._output(len(logits))

    def _output(self, n: int) -> SamplerOutput:
        return SamplerOutput(token_ids=[self.token] * n, logprobs=[None] * n)


def _transport(times: StepTimes, writer: ShmChannel, reader: ShmChannel, runner: NullRunner,
               sizes: list[int]) -> Callable[[StepPlan], None]:
    """Rank 0's ``Runtime.send`` plus the worker's ``decode(channel.read())``, each stage timed."""
    cur = times.current

    def send(plan: StepPlan) -> None:
        t0 = _now()
        data = encode(plan)
        t1 = _now()
        writer.write(data)
        t2 = _now()
        received = reader.read()
        t3 = _now()
        runner.received = decode(received)
        t4 = _now()
        cur["encode"] += t1 - t0
        cur["write"] += t2 - t1
        cur["read"] += t3 - t2
        cur["decode"] += t4 - t3
        sizes.append(len(data))

    return send


def _is_steady_decode(engine: Engine, num_seqs: int) -> bool:
    sched = engine.scheduler
    return (
        not sched.waiting
        and len(sched.running) == num_seqs
        and all(s.num_computed_tokens == s.num_tokens - 1 for s in sched.running)
    )


def run_case(model_dir: Path, num_seqs: int, steps: int, warmup: int, prompt_len: int, block_size: int,
             split_detok: bool = False, profile: cProfile.Profile | None = None,
             gc_freeze: bool = False) -> tuple[list[dict[str, int]], int]:
    """Measure ``steps`` decode steps at ``num_seqs`` running sequences; returns per-step times and bytes/step."""
    times = StepTimes()
    max_tokens = warmup + steps + 8  # never reached: no sequence finishes while measuring
    max_model_len = prompt_len + max_tokens + block_size
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 16
    config = RtpConfig(model=ModelConfig(max_model_len=max_model_len), parallel=ParallelConfig(device="cpu"),
                       cache=CacheConfig(enable_prefix_caching=True),
                       scheduler=SchedulerConfig(max_num_seqs=max(num_seqs, 1)))
    plain_add, plain_flush = IncrementalDetokenizer.add, IncrementalDetokenizer.flush
    name = make_segment_name("rtpbench_")
    writer = ShmChannel.create(name, num_readers=1, chunk_bytes=config.parallel.shm_chunk_bytes,
                               num_chunks=config.parallel.shm_num_chunks)
    reader: ShmChannel | None = None
    try:
        reader = ShmChannel.attach(name, 0, timeout=5)
        sizes: list[int] = []
        vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))  # the engine checks prompts against it
        runner = NullRunner(times, block_size, num_blocks, max_model_len, vocab=vocab)
        engine = Engine(config, runner, model_dir, transport=_transport(times, writer, reader, runner, sizes))
        token = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
        assert token not in engine.eos_token_ids
        sampler = FixedSampler(token)
        sampler.sample = times.timed("sample", sampler.sample)  # type: ignore[method-assign]
        sampler.sample_greedy = times.timed("sample", sampler.sample_greedy)  # type: ignore[method-assign]
        engine.sampler = sampler  # type: ignore[assignment]
        if gc_freeze:  # as at the end of start-up: everything so far leaves the collector's view
            gc.collect()
            gc.freeze()
        sched = engine.scheduler
        sched.schedule = times.timed("schedule", sched.schedule)  # type: ignore[method-assign]
        sched.postprocess = times.timed("postproc", sched.postprocess)  # type: ignore[method-assign]
        if split_detok:  # every request's detokenizer, timed (class attributes, restored below)
            IncrementalDetokenizer.add = times.timed("detok", plain_add)  # type: ignore[method-assign]
            IncrementalDetokenizer.flush = times.timed("detok", plain_flush)  # type: ignore[method-assign]

        # Prompts share a 64-token prefix (prefix caching at work), then differ.
        rng = random.Random(num_seqs)
        text_vocab = [i for i in range(len(engine.tokenizer)) if i not in engine.eos_token_ids][:440]
        shared = [rng.choice(text_vocab) for _ in range(min(64, prompt_len - 1))]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        for _ in range(num_seqs):
            own = [rng.choice(text_vocab) for _ in range(prompt_len - len(shared))]
            engine.add_request(shared + own, params)
        for _ in range(10_000):  # prefill, until every sequence is decoding
            engine.step()
            if _is_steady_decode(engine, num_seqs):
                break
        else:
            raise AssertionError("sequences did not reach steady-state decode")

        for i in range(warmup + steps):
            times.reset()
            sizes.clear()
            if profile is not None and i == warmup:
                profile.enable()
            t0 = _now()
            outs = engine.step()
            total = _now() - t0
            batch = runner.last_batch
            # Every measured step must be a pure decode step of every sequence.
            assert len(outs) == num_seqs and not any(o.finished for o in outs), "a sequence finished"
            assert batch is not None and batch.num_tokens == num_seqs == len(batch.sample_indices)
            if i >= warmup:
                step = dict(times.current)
                step["engine"] = total - sum(v for k, v in step.items() if k != "engine")
                step["total"] = total
                times.steps.append(step)
        if profile is not None:
            profile.disable()
        return times.steps, sizes[-1]
    finally:
        if gc_freeze:
            gc.unfreeze()
        IncrementalDetokenizer.add, IncrementalDetokenizer.flush = plain_add, plain_flush  # type: ignore[method-assign]
        if reader is not None:
            reader.close()
        writer.close()
        writer.unlink()


def _pct(values: list[int], q: float) -> float:
    """The q-quantile of ``values`` in microseconds."""
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1,64,256", help="comma-separated numbers of running sequences")
    parser.add_argument("--steps", type=int, default=300, help="measured decode steps per case")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured decode steps before measuring")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--split-detok", action="store_true",
                        help="time the detokenizer apart from the rest of the engine's bookkeeping")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the engine is built, before any request (as a start-up path could)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the measured steps of the largest case (its timings then include the profiler)")
    args = parser.parse_args()
    cases = [int(s) for s in args.seqs.split(",")]
    model_dir = default_model_dir()

    results: dict[int, list[dict[str, int]]] = {}
    nbytes: dict[int, int] = {}
    prof: cProfile.Profile | None = None
    for n in cases:
        prof = cProfile.Profile() if args.profile and n == max(cases) else None
        results[n], nbytes[n] = run_case(model_dir, n, args.steps, args.warmup, args.prompt_len,
                                         args.block_size, args.split_detok, prof, args.gc_freeze)
        if prof is not None:
            stats = pstats.Stats(prof).strip_dirs().sort_stats("tottime")
            print(f"--- cProfile, {n} sequences, {args.steps} steps, by own time ---")
            stats.print_stats(25)

    head = "".join(f"{f'{n} seq' + 's' * (n != 1):>18}" for n in cases)
    print(f"us per decode step (median / p90), prompt {args.prompt_len}, block size {args.block_size}, "
          f"{args.steps} steps after {args.warmup} warm-up")
    print(f"{'stage':<10}{head}")
    for stage in (*STAGES, "total"):
        if stage == "detok" and not args.split_detok:
            continue
        cells = "".join(
            f"{_pct([s[stage] for s in results[n]], 0.5):>9.1f} /{_pct([s[stage] for s in results[n]], 0.9):>6.1f}"
            for n in cases
        )
        print(f"{stage:<10}{cells}")
    print(f"{'plan B':<10}" + "".join(f"{nbytes[n]:>18}" for n in cases))
    print("total = whole Engine.step (its own median / p90, not the sum of the stage columns)")


if __name__ == "__main__":
    main()
