"""The GPU path of one rank, traced with fake CUDA tensors: start-up, steps, CUDA graphs, sampler.

:func:`run_rank` builds the real :class:`~rtp.runtime.model_runner.ModelRunner` on ``cuda:<rank>``
inside ``FakeTensorMode`` (weights, KV cache and activations are fake tensors: shapes, dtypes and
devices without storage), with :class:`~rtp.fake_cuda.device.FakeCuda` answering ``torch.cuda``,
the fake process group of torch.distributed for TP > 1, and a
:class:`~rtp.fake_cuda.monitor.StepMonitor` on every op. It then drives a prefill, mixed steps,
decode steps at several batch sizes (graph replay with padding, and an eager batch above the
largest graph) and the sampler, and returns one :class:`StageResult` per stage.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from rtp.config import CacheConfig, ModelConfig, ParallelConfig, RtpConfig, SchedulerConfig
from rtp.core.step import CachedSeqs, StepPlan
from rtp.distributed.parallel import ParallelState
from rtp.fake_cuda.device import FakeCuda, FakeCudaSpec
from rtp.fake_cuda.monitor import StepMonitor
from rtp.fake_cuda.plans import ScriptedPlans
from rtp.model import loader
from rtp.model.linear import LinearBase
from rtp.model.moe import FusedMoE
from rtp.model.quant.base import PACKED_QUANT
from rtp.runtime import model_runner
from rtp.runtime.model_runner import ModelRunner
from rtp.runtime.sampler import PenaltyState, Sampler, SampleRow
from rtp.sampling import SamplingParams

GRAPH_MAX_BATCH = 4  # graphs for batch sizes 1, 2, 4
DECODE_BATCHES = (1, 3, 6)  # a graph's exact size, padded to 4, above the largest graph (eager)


@dataclass(frozen=True)
class Case:
    """One configuration of the dry run."""

    model: str  # "dense", "moe", or a quantized checkpoint: "moe-fp8", "dense-awq"
    tp: int
    backend: str  # attention backend forced on the runner: "triton" or "torch"
    expert_parallel: bool = False
    capability: tuple[int, int] = FakeCudaSpec.capability  # of the pretend GPUs (FP8 products from (8, 9))
    kv_cache_dtype: str = "auto"  # or "fp8_e4m3"

    @property
    def model_label(self) -> str:
        label = f"{self.model} (EP)" if self.expert_parallel else self.model
        if self.kv_cache_dtype != "auto":
            label = f"{label}, {self.kv_cache_dtype} KV"
        major, minor = self.capability
        return label if self.capability == FakeCudaSpec.capability else f"{label} (sm{major}{minor})"


@dataclass
class StageResult:
    """How one stage went on one rank."""

    stage: str
    status: str  # "PASS", "FAIL" or "SKIP"
    note: str = ""
    error: str = ""  # the formatted stack of a failure


class _FakeWorld(ParallelState):
    """A rank of a TP group on torch.distributed's fake process group.

    The fake group runs every collective without moving data, so ``min_int`` (a MIN over ranks read back
    on the host) answers with this rank's value, which is what every rank of a uniform fake world holds, and
    ``all_gather_object`` with this rank's object on every rank (objects read back on the host cannot cross it
    either).
    """

    def min_int(self, value: int) -> int:
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:  # noqa: ANN401 - as ParallelState's
        return [obj] * self.world_size


@contextlib.contextmanager
def _world(tp: int, rank: int) -> Iterator[ParallelState]:
    device = torch.device("cuda", rank)
    if tp == 1:
        yield ParallelState(rank=0, world_size=1, local_rank=0, device=device)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run needs its own torch.distributed world; one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        group = dist.group.WORLD
        yield _FakeWorld(rank=rank, world_size=tp, local_rank=rank, device=device, tp_group=group, cpu_group=group)
    finally:
        dist.destroy_process_group()


class _RealReads:
    """A safetensors file for the loader under fake mode: each slice is read as a real CPU tensor.

    A safetensors slice builds its tensor on a storage, which fake mode cannot wrap; reading outside
    fake mode keeps the real loader (names, shapes, every ``weight_loader``'s slicing) and hands each
    parameter's ``copy_`` a real CPU tensor, as on a GPU machine.
    """

    def __init__(self, opened: Any) -> None:
        self._opened = opened  # what safetensors.safe_open returned (a context manager)

    def __enter__(self) -> _RealReads:
        self._handle = self._opened.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._opened.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def get_slice(self, name: str) -> _RealSlice:
        return _RealSlice(self._handle.get_slice(name))


class _RealSlice:
    def __init__(self, source: Any) -> None:
        self._source = source

    def get_shape(self) -> list[int]:
        return self._source.get_shape()

    def get_dtype(self) -> str:
        return self._source.get_dtype()

    def __getitem__(self, idx: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return self._source[idx]


@contextlib.contextmanager
def _real_reads() -> Iterator[None]:
    """Route the loader's ``safe_open`` through :class:`_RealReads`."""
    real_open = loader.safe_open

    def open_file(path: str, framework: str = "pt", device: str = "cpu") -> _RealReads:
        return _RealReads(real_open(path, framework=framework, device=device))

    loader.safe_open = open_file  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        loader.safe_open = real_open  # type: ignore[misc]


class _Stages:
    """Runs stages one after the other, each caught and recorded."""

    def __init__(self, monitor: StepMonitor) -> None:
        self.monitor = monitor
        self.results: list[StageResult] = []
        self.broken = ""  # why later stages cannot run (set when start-up fails)

    def run(self, stage: str, fn: Callable[[], str], *, region: bool = True) -> None:
        if self.broken:
            self.results.append(StageResult(stage, "SKIP", self.broken))
            return
        before = len(self.monitor.syncs)
        try:
            with self.monitor.region(stage) if region else contextlib.nullcontext():
                note = fn()
        except Exception as e:  # noqa: BLE001 - every failure becomes a row with its stack
            err = "".join(traceback.format_exception(e))
            self.results.append(StageResult(stage, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", err))
            return
        places = sorted({s.where for s in self.monitor.syncs[before:]})
        if places:  # (a .tolist() reads element by element here: one place, not one per element, is one sync)
            more = f" and {len(places) - 3} more" if len(places) > 3 else ""
            note = (note + "; " if note else "") + f"host syncs (not captured) at {', '.join(places[:3])}{more}"
        self.results.append(StageResult(stage, "PASS", note))


def _check_placement(runner: ModelRunner, device: torch.device, dtype: torch.dtype) -> str:
    """Every parameter on ``device`` in ``dtype``; buffers on ``device``; the KV cache too, in its own dtype."""
    for name, p in runner.model.named_parameters():
        if p.device != device or (p.is_floating_point() and p.dtype != dtype):
            raise AssertionError(f"parameter {name} is {p.dtype} on {p.device}; expected {dtype} on {device}")
    fp32_buffers = []
    for name, b in runner.model.named_buffers():
        if b.device != device:
            raise AssertionError(f"buffer {name} is on {b.device}; expected {device}")
        if b.is_floating_point() and b.dtype != dtype:
            fp32_buffers.append(name.rsplit(".", 1)[-1])
    cache_dtype = runner.kv_cache_dtype
    for i, attn in enumerate(runner.model.attention_layers()):
        for cache in (attn.k_cache, attn.v_cache):
            if cache.device != device or cache.dtype != cache_dtype or cache.shape[0] != runner.num_blocks:
                raise AssertionError(f"layer {i}: KV cache {cache.dtype}{list(cache.shape)} on {cache.device}; "
                                     f"expected {cache_dtype} [{runner.num_blocks}, ...] on {device}")
    extra = f"; {dtype} params; buffers in another dtype: {sorted(set(fp32_buffers))}" if fp32_buffers else ""
    kv = f" ({str(cache_dtype).removeprefix('torch.')})" if cache_dtype != dtype else ""
    return f"{runner.num_blocks} KV blocks of {runner.block_size}{kv}{extra}{_packed_note(runner.model)}"



def _packed_note(model: torch.nn.Module) -> str:
    """How many projections and expert stacks of a quantized checkpoint stay packed for the quantized kernels."""
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, LinearBase) and m.quant_packed is not None:
            if m.method is not PACKED_QUANT:
                raise AssertionError(f"a {type(m).__name__} holds packed weights but runs {type(m.method).__name__}")
            packed: object = m.quant_packed
        elif isinstance(m, FusedMoE) and m.fp8 is not None:
            packed = m.fp8
        else:
            continue
        kind = type(packed).__name__ + (" (w8a8)" if getattr(packed, "w8a8", False) else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    return "".join(f"; {n} x {kind}" for kind, n in sorted(kinds.items()))


def _check_graphs(runner: ModelRunner, fake: FakeCuda, device: torch.device, dtype: torch.dtype) -> str:
    graphs = runner.graphs
    if graphs is None:
        return ""
    if sorted(graphs.graphs) != graphs.sizes:
        raise AssertionError(f"graphs for batch sizes {sorted(graphs.graphs)}, expected {graphs.sizes}")
    recorded = fake.graphs
    if [g.record.captures for g in recorded] != [1] * len(graphs.sizes):
        raise AssertionError(f"captures per graph: {[g.record.captures for g in recorded]}")
    first = recorded[0]
    if first.record.pool is not None or any(g.record.pool is not first.pool() for g in recorded[1:]):
        raise AssertionError("every graph after the first must capture into the first graph's memory pool")
    if graphs.graphs[graphs.sizes[-1]] is not first:
        raise AssertionError("the largest batch must be captured first (the smaller graphs reuse its pool)")
    n = graphs.sizes[-1]
    want = {"ids": (torch.long, (n,)), "pos": (torch.long, (n,)), "slots": (torch.long, (n,)),
            "ctx": (torch.int32, (n,)), "tables": (torch.int32, (n, graphs.max_blocks)),
            "out": (dtype, (n, runner.spec.hidden_size))}
    for name, (dt, shape) in want.items():
        t = getattr(graphs, name)
        if t.device != device or t.dtype != dt or tuple(t.shape) != shape:
            raise AssertionError(f"static buffer {name} is {t.dtype}{list(t.shape)} on {t.device}; "
                                 f"expected {dt}{list(shape)} on {device}")
    return f"captured {len(recorded)} graphs (batch sizes {graphs.sizes}), one shared pool"


def _check_logits(logits: torch.Tensor | None, rank: int, rows: int, vocab: int, device: torch.device) -> str:
    if rank != 0:
        if logits is not None:
            raise AssertionError(f"rank {rank} returned logits; only rank 0 gathers them")
        return "no logits (rank > 0)"
    if rows == 0:
        if logits is not None:
            raise AssertionError("logits for a step that samples nothing")
        return "nothing sampled"
    ok = logits is not None and tuple(logits.shape) == (rows, vocab) and logits.dtype == torch.float32
    if not ok or logits is None or logits.device != device:
        got = "None" if logits is None else f"{logits.dtype}{list(logits.shape)} on {logits.device}"
        raise AssertionError(f"logits {got}; expected float32 [{rows}, {vocab}] on {device}")
    return f"logits float32 [{rows}, {vocab}]"


def _sample(sampler: Sampler, logits: torch.Tensor) -> str:
    """Every feature of the batched sampler at once, on cuda logits."""
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
             SamplingParams(temperature=1.0, seed=1234), SamplingParams(temperature=0.7, logprobs=3),
             SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
             SamplingParams(temperature=1.0, logit_bias={5: 2.0, 9: -100.0}, min_tokens=4),
             SamplingParams(temperature=0.9, allowed_token_ids=[3, 4, 5, 6])]
    rows = [SampleRow(plain[i % len(plain)], num_generated=2, token_ids=[3, 4, 5, 6, 7, 7], num_prompt_tokens=4,
                      penalty_state=PenaltyState()) for i in range(logits.shape[0])]
    out = sampler.sample(logits, rows)
    if len(out.token_ids) != len(rows) or len(out.logprobs) != len(rows):
        raise AssertionError(f"{len(out.token_ids)} tokens for {len(rows)} rows")
    greedy = sampler.sample_greedy(logits)
    if len(greedy.token_ids) != len(rows):
        raise AssertionError(f"sample_greedy gave {len(greedy.token_ids)} tokens for {len(rows)} rows")
    return f"{len(rows)} rows: greedy, top-k/p/min-p, seeded, logprobs, penalties, bias, allowed ids"


@dataclass
class _Counter:
    """Counts the calls of the wrapped callable (the model's eager forward)."""

    wrapped: Callable[..., Any]
    calls: int = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.wrapped(*args, **kwargs)


def build_runner(ps: ParallelState, model_dir: Path, case: Case) -> ModelRunner:
    """The runner as a GPU deployment builds it: bf16, KV cache sized from memory, CUDA graphs on."""
    config = RtpConfig(
        model=ModelConfig(dtype="bfloat16", max_model_len=512, enforce_eager=False,
                          cuda_graph_max_batch=GRAPH_MAX_BATCH),
        parallel=ParallelConfig(expert_parallel=case.expert_parallel),
        cache=CacheConfig(kv_cache_dtype=case.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    return ModelRunner(ps, model_dir, config)


class _Steps:
    """The stages after start-up, on one built runner."""

    def __init__(self, runner: ModelRunner, fake: FakeCuda, ps: ParallelState) -> None:
        self.runner, self.fake, self.ps = runner, fake, ps
        self.vocab = runner.spec.vocab_size
        self.plans = ScriptedPlans(runner.block_size, self.vocab)
        self.forward = _Counter(runner.model.forward)
        runner.model.forward = self.forward  # type: ignore[method-assign]
        self.logits: torch.Tensor | None = None  # rank 0: the last step's

    def step(self, plan: StepPlan, samples: int) -> str:
        logits = self.runner.execute(plan).sample_logits
        note = _check_logits(logits, self.ps.rank, samples, self.vocab, self.ps.device)
        if logits is not None:
            self.logits = logits
        return note

    def prefill(self) -> str:
        prompts = [5, 17, 33, 2, 16, 40, 9, 3]  # one block, several, exactly one (16), a partial last block
        note = self.step(StepPlan(new_seqs=[self.plans.new_seq(n) for n in prompts]), len(prompts))
        return f"{len(prompts)} prompts, {sum(prompts)} tokens; {note}"

    def mixed(self) -> str:
        chunked = self.plans.new_seq(50, chunk=20)
        self.step(StepPlan(new_seqs=[chunked], cached_seqs=CachedSeqs(self.plans.decode(i) for i in range(4))), 4)
        rest = [self.plans.next_chunk(chunked.seq_id), *(self.plans.decode(i) for i in range(4, 8))]
        note = self.step(StepPlan(cached_seqs=CachedSeqs(rest)), 5)
        return f"50-token prompt in chunks of 20 + 30, beside 4 decode rows each; {note}"

    def decode(self, batch: int) -> str:
        graphs, recorded = self.runner.graphs, self.fake.graphs
        replays = [g.record.replays for g in recorded]
        calls = self.forward.calls
        note = self.step(self.plans.decode_plan(list(range(batch))), batch)
        if graphs is None:
            return f"eager; {note}"
        got = [g.record.replays - r for g, r in zip(recorded, replays)]
        size = next((s for s in graphs.sizes if s >= batch), None)
        if size is None:
            if any(got) or self.forward.calls != calls + 1:
                raise AssertionError(f"batch {batch} is above the largest graph: replays {got} and "
                                     f"{self.forward.calls - calls} eager forwards (expected none and one)")
            return f"eager (above the largest graph, {graphs.sizes[-1]}); {note}"
        want = [1 if g is graphs.graphs[size] else 0 for g in recorded]
        if got != want or self.forward.calls != calls:
            raise AssertionError(f"batch {batch}: replays per graph {got}, expected {want} (the graph of {size}); "
                                 f"{self.forward.calls - calls} eager forwards (expected none)")
        pad = f", {size - batch} padding rows" if size > batch else ""
        return f"graph {size} replayed{pad}; {note}"

    def argmax(self, batch: int = 5) -> str:
        """A plain-greedy decode step: rank 0 gets the tokens the ranks picked from their vocabulary shards."""
        plan = self.plans.decode_plan(list(range(batch)))
        plan.sample_argmax = True
        out = self.runner.execute(plan)
        tokens = out.sample_tokens
        if out.sample_logits is not None:
            raise AssertionError("logits for a sample_argmax step: the ranks were to pick the tokens")
        if self.ps.rank != 0:
            if tokens is not None:
                raise AssertionError(f"rank {self.ps.rank} returned tokens; only rank 0 gets them")
            return "no tokens (rank > 0)"
        if tokens is None or tuple(tokens.shape) != (batch,) or tokens.dtype != torch.int64 or \
                tokens.device != self.ps.device:
            got = "None" if tokens is None else f"{tokens.dtype}{list(tokens.shape)} on {tokens.device}"
            raise AssertionError(f"tokens {got}; expected int64 [{batch}] on {self.ps.device}")
        return f"tokens int64 [{batch}], no logits gathered"

    def sample(self) -> str:
        if self.logits is None:
            raise AssertionError("no logits to sample from")
        return _sample(Sampler(eos_token_ids=[2], seed=0), self.logits)


STAGES = ("start-up (load, profile, KV sizing)", "CUDA-graph capture", "prefill", "mixed",
          *(f"decode bs={b}" for b in DECODE_BATCHES), "greedy tokens from vocabulary shards", "sampler")


def run_rank(case: Case, rank: int, model_dir: Path) -> list[StageResult]:
    """Trace one rank of ``case`` (see the module docstring); a failed stage is a result, never an exception."""
    monitor = StepMonitor()
    fake = FakeCuda(FakeCudaSpec(capability=case.capability), on_capture=monitor.set_capturing)
    stages = _Stages(monitor)
    dtype = torch.bfloat16
    saved_choice = model_runner.choose_attn_backend
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake.activate())
        ps = stack.enter_context(_world(case.tp, rank))
        torch.cuda.set_device(ps.device)  # as ParallelState.from_env does before creating the NCCL group
        model_runner.choose_attn_backend = lambda *args: case.backend  # type: ignore[assignment]
        stack.callback(setattr, model_runner, "choose_attn_backend", saved_choice)
        stack.enter_context(_real_reads())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(monitor)
        built: list[ModelRunner] = []

        def start() -> str:
            built.append(build_runner(ps, model_dir, case))
            return _check_placement(built[0], ps.device, dtype)

        stages.run(STAGES[0], start, region=False)
        if not built:
            stages.broken = "start-up failed"
            for stage in STAGES[1:]:
                stages.run(stage, lambda: "")
            return stages.results
        steps = _Steps(built[0], fake, ps)
        if steps.runner.graphs is None:
            stages.results.append(StageResult(STAGES[1], "SKIP", f"the {case.backend} backend decodes eagerly"))
        else:
            stages.run(STAGES[1], lambda: _check_graphs(steps.runner, fake, ps.device, dtype), region=False)
        stages.run("prefill", steps.prefill)
        stages.run("mixed", steps.mixed)
        for batch in DECODE_BATCHES:
            stages.run(f"decode bs={batch}", functools.partial(steps.decode, batch))
        stages.run("greedy tokens from vocabulary shards", steps.argmax)
        if ps.rank != 0:
            stages.results.append(StageResult("sampler", "SKIP", "rank 0 samples"))
        else:
            stages.run("sampler", steps.sample)
    return stages.results
