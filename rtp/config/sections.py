"""The config's sections as frozen dataclasses, each field with its default, its rule and its docstring.

:class:`RtpConfig` groups them: ``config.model``, ``config.parallel``,
``config.cache``, ``config.scheduler``, ``config.liveness``, ``config.server``,
``config.speculative_config``, plus ``config.log_level``. Every section validates itself when built, so a
directly constructed section is as checked as one loaded from YAML.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

from rtp.config.rules import (
    BOOL,
    check_value,
    choice,
    int_list,
    integer,
    number,
    power_of_two,
    rule_of,
    setting,
    short_repr,
    text,
    type_name,
)
from rtp.errors import ConfigError


class Given(NamedTuple):
    """A value as the user gave it: the key as written ("block_size" or "cache.block_size") and its source."""

    value: Any
    key: str
    source: str


class Section:
    """Base of a config section: validated (and normalised in place) when built."""

    flat: ClassVar[bool] = True
    """Whether the fields also have top-level YAML keys (``block_size:`` for ``cache.block_size``)."""
    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by @dataclass on each section: dataclasses.fields works

    def __post_init__(self) -> None:
        cls = type(self)
        given = {f.name: Given(getattr(self, f.name), f.name, cls.__name__) for f in fields(self)}
        for name, value in validated(cls, given).items():
            if value is not given[name].value:
                object.__setattr__(self, name, value)  # frozen: normalise (int -> float, ...) in place

    @classmethod
    def joint_rule(cls, values: Mapping[str, Any], key_of: Callable[[str], str]) -> tuple[str, str] | None:
        """(field, what is allowed) of a rule joining several fields that ``values`` break, else None."""
        return None


def section(cls: type[Section]) -> Any:
    """An :class:`RtpConfig` field holding the section ``cls`` (a YAML mapping, or None for its defaults)."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(frozen=True)
class ModelConfig(Section):
    """The checkpoint and how its forward pass runs."""

    path: str | None = setting(None, text("a checkpoint folder path", nullable=True), flat="model")
    """Hugging Face checkpoint folder; None means the small trained Qwen3 shipped in ``rtp/assets``."""
    dtype: str = setting("auto", choice("auto", "float32", "bfloat16", "float16", aliases={
        "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}))
    """"auto" (bfloat16 on cuda and on CPUs with AVX-512 BF16 or AMX, else float32), "float32", "bfloat16",
    "float16" (vLLM's "half", "fp16", "float", "fp32", "bf16" are accepted and stored as these)."""
    quantization: str | None = setting(None, choice("int8", nullable=True))
    """"int8": int8 attention and MLP projections and LM head, per-output-channel scales computed at load
    from a float (or FP8/AWQ) checkpoint; for CPU decode, which reads 4x fewer weight bytes than in fp32
    (on CPUs with AVX-512 VNNI the activations are quantized too, per group of 128 inputs, and the
    products computed in int8). None: the checkpoint's own format (a quantized checkpoint's
    quantization_config is always read)."""
    max_model_len: int | None = setting(None, integer(1, nullable=True))
    """Longest prompt + completion in tokens, >= 1; None means the model's max_position_embeddings. A value past
    the positions the model covers (max_position_embeddings, stretched by a linear or yarn RoPE scaling) is refused."""
    enforce_eager: bool = setting(False, BOOL)
    """True disables CUDA graphs (every decode step runs eagerly)."""
    cuda_graph_max_batch: int = setting(256, integer(1))
    """Largest decode batch captured in a CUDA graph, >= 1; larger batches run eagerly."""
    seed: int = setting(0, integer(0, 2**63 - 1))
    """Seed of the default random generator, in [0, 2**63 - 1] (requests may bring their own)."""
    batch_invariant: bool = setting(False, BOOL)
    """True: a request's tokens do not depend on what else is batched with it, nor on how its prompt is chunked
    (greedy and seeded sampling alike, bfloat16 included): every attention row takes the varlen kernel, whose rows
    read their keys in blocks fixed by position, and every linear rtp's panel GEMM, whose rows sum in one order
    (as vLLM's batch-invariant mode). CPU, float32 or bfloat16 weights (no int8); decode steps took 1.19x (fp32)
    and 1.12-1.26x (bf16) as long at Qwen3-0.6B's dimensions with 8 requests (on an AVX-512 host, before the
    varlen kernel took decode rows in 2-row tiles)."""
    generation_config: str = setting("auto", choice("auto", "none", aliases={"vllm": "none"}))
    """"auto": the checkpoint's generation_config.json sampling settings (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens as max_tokens) become the defaults of requests that leave them unset,
    as vLLM does; "none" (or vLLM's "vllm"): rtp's own defaults (temperature 1.0, no top-p/top-k/min-p)."""


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the ranks split the model, where they run, and the ring that carries their step plans."""

    tensor_parallel_size: int | None = setting(None, integer(1, nullable=True))
    """Number of ranks each pipeline stage's layers (or each data-parallel replica) are split over; None means
    torchrun's WORLD_SIZE divided by ``pipeline_parallel_size`` x ``data_parallel_size`` (GPU topology files fix
    it)."""
    data_parallel_size: int = setting(1, integer(1))
    """Number of independent replicas of the model, >= 1, each split over tensor_parallel_size ranks: the world
    is data_parallel_size x tensor_parallel_size ranks (global rank = replica * TP + TP rank). Each replica is
    a full engine (scheduler, KV cache, step channel); the server routes every request to one of them. Across
    nodes (torchrun --nnodes) each replica's ranks must be on one node. Not yet with pipeline_parallel_size > 1."""
    data_parallel_size_local: int | None = setting(None, integer(1, nullable=True))
    """Replicas on this node, >= 1 and <= data_parallel_size (vLLM's --data-parallel-size-local); None derives
    it (the node's ranks / tensor_parallel_size). Given, it is a cross-check: a node holding another number
    fails at start, before the model loads."""
    pipeline_parallel_size: int = setting(1, integer(1))
    """Number of pipeline stages, >= 1: stage ``s`` holds a contiguous range of layers on ranks
    ``s*TP .. s*TP+TP-1`` (the world is TP x PP ranks); the first stage embeds, the last applies the final
    norm, and rank 0 holds the whole LM head and samples. Pick it to span nodes: one hidden-state tensor
    crosses each stage boundary per step."""
    pipeline_layer_partition: tuple[int, ...] | None = setting(None, int_list(1, nullable=True))
    """Layers of each pipeline stage, first stage first (one entry >= 1 per stage, summing to the model's
    layer count); None: an even split, the remainder going to the middle stages, then the last. Not read
    with one stage."""
    pipeline_steps_in_flight: int | None = setting(None, integer(1, nullable=True))
    """With pipeline stages: most steps rank 0 keeps in flight, each over its own requests (a request in
    flight is scheduled again once its step's tokens are back), >= 1; None means pipeline_parallel_size,
    so every stage has work; 1 runs one step at a time. Speculative decoding always runs one at a time."""
    device: str = setting("auto", choice("auto", "cpu", "cuda"))
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    expert_parallel: bool = setting(False, BOOL)
    """MoE models only: each rank holds num_experts / TP whole experts instead of a 1/TP slice of each."""
    shm_chunk_bytes: int = setting(1 << 20, integer(4096))
    """Size of one chunk of the shared-memory ring that carries step plans, >= 4096; larger messages span
    chunks."""
    shm_num_chunks: int = setting(4, integer(2))
    """Number of chunks in the shared-memory ring, >= 2."""


    @classmethod
    def joint_rule(cls, values: Mapping[str, Any], key_of: Callable[[str], str]) -> tuple[str, str] | None:
        partition, pp = values["pipeline_layer_partition"], values["pipeline_parallel_size"]
        if partition is not None and pp > 1 and len(partition) != pp:
            return "pipeline_layer_partition", f"one entry per stage ({key_of('pipeline_parallel_size')}={pp})"
        local, dp = values["data_parallel_size_local"], values["data_parallel_size"]
        if local is not None and dp > 1 and local > dp:  # dp 1: see ParallelState.from_env
            return "data_parallel_size_local", f"at most {key_of('data_parallel_size')}={dp}"
        return None


@dataclass(frozen=True)
class CacheConfig(Section):
    """The paged KV cache: block size, how many blocks, prefix reuse."""

    block_size: int | None = setting(None, power_of_two(1, 1024, nullable=True))
    """Tokens per KV block; a power of two in 1..1024, or None for 256 with flash-attn and 16 otherwise.

    flash-attn's paged path needs a multiple of 256; the runtime checks that on CUDA.
    """
    enable_prefix_caching: bool = setting(True, BOOL)
    """Reuse KV blocks of identical prompt prefixes across requests."""
    gpu_memory_utilization: float = setting(0.9, number("a number in (0, 1]", lambda v: 0.0 < v <= 1.0))
    """Fraction of each GPU's memory that weights, activations and the KV cache may use, in (0, 1]."""
    num_kv_blocks: int | None = setting(None, integer(1, nullable=True))
    """Fixed number of KV blocks per rank (>= 1), overriding the memory-based sizing."""
    cpu_kv_cache_gib: float = setting(1.0, number("a number > 0", lambda v: v > 0.0))
    """KV cache size per rank on CPU, in GiB, > 0."""
    kv_cache_dtype: str = setting("auto", choice("auto", "fp8_e4m3", aliases={"fp8": "fp8_e4m3"}))
    """"auto": the KV cache in the model's compute dtype; "fp8_e4m3" (or vLLM's "fp8"): float8_e4m3fn with
    per-layer k/v scales (the checkpoint's ``self_attn.k_scale`` / ``v_scale``, else 1.0), one byte per
    element, so the same memory holds twice the blocks of a bf16 cache. On CUDA it is read by the Triton
    attention (not flash-attn 2), on CPU by the torch path (not the C++ kernels)."""


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """How many sequences and tokens one step may hold."""

    max_num_seqs: int = setting(256, integer(1))
    """Most sequences running at once, >= 1."""
    max_num_batched_tokens: int | None = setting(None, integer(1, nullable=True))
    """Most query tokens in one step, >= 1; chunked prefill splits longer prompts. null: 8192 on GPU; on CPU
    the largest power of two up to 8192 that keeps a step's largest activation within 32 MiB (at least
    max_num_seqs): 1024 for Qwen3-0.6B in fp32, 2048 in bf16 (see ``step_token_budget``)."""


@dataclass(frozen=True)
class LivenessConfig(Section):
    """When a rank counts as hung and a step as stuck."""

    timeout_s: float = setting(10.0, number("a number in (0, 3600]", lambda v: 0.0 < v <= 3600.0),
                               flat="liveness_timeout_s")
    """Seconds without a heartbeat after which a rank is declared hung, in (0, 3600].

    Every rank's heartbeat thread beats ten times per timeout, also during long
    steps and compiles; a stopped, swapped-out or driver-stuck process stops
    beating and is caught within this bound plus about a second. A rank whose
    process exits is noticed within about a second whatever this is.
    Collectives time out after max(this, 60) seconds (startup skew between ranks).
    """
    step_timeout_s: float | None = setting(
        300.0, number("a number in (0, 86400]", lambda v: 0.0 < v <= 86400.0, nullable=True))
    """Seconds one step may run before it is reported as stuck, in (0, 86400], or null for no limit.

    A stuck step makes every rank dump its Python stacks to the log and fails
    the run with an error naming the ranks that had not finished it. Leave room
    for the longest prefill chunk and for first-step compiles.
    """


@dataclass(frozen=True)
class ServerConfig(Section):
    """Settings of the OpenAI-compatible HTTP server (rank 0 only)."""

    flat: ClassVar[bool] = False  # server settings always sit under `server:`

    host: str = setting("127.0.0.1", text("a non-empty host name or IP address"))
    """Address to listen on; the default serves the local machine only (use 0.0.0.0 to expose it)."""
    port: int = setting(8000, integer(0, 65535))
    """TCP port, 0..65535; 0 lets the OS pick a free port."""
    # repr=False: the key must never end up in a log line through repr(config).
    api_key: str | None = setting(None, text("a non-empty string", nullable=True), repr=False)
    """When set, every endpoint but /health needs the header "Authorization: Bearer <key>"."""
    served_model_name: str | None = setting(None, text("a non-empty string", nullable=True))
    """Model name reported by /v1/models and accepted in requests; None means the model folder's name."""
    max_request_bytes: int = setting(1 << 20, integer(1))
    """Request bodies larger than this many bytes (>= 1) are rejected with HTTP 413."""
    max_tokens_limit: int = setting(4096, integer(1))
    """Upper bound on a request's max_tokens, >= 1."""
    default_max_tokens: int = setting(256, integer(1))
    """max_tokens used when a request gives none; in [1, max_tokens_limit]."""
    shutdown_grace_s: float = setting(30.0, number("a number in [0, 86400]", lambda v: 0.0 <= v <= 86400.0))
    """On SIGTERM, seconds that running requests may take to finish before they are aborted, in [0, 86400]."""
    reasoning_parser: str | None = setting(None, choice("qwen3", nullable=True))
    """"qwen3" splits chat outputs' <think>...</think> into reasoning_content (vLLM's --reasoning-parser)."""
    tool_call_parser: str | None = setting(None, choice("hermes", "qwen3", nullable=True))
    """"hermes" (or its alias "qwen3") parses <tool_call> blocks into tool_calls (vLLM's --tool-call-parser)."""
    enable_auto_tool_choice: bool = setting(False, BOOL)
    """Allow tool_choice "auto" (the default with tools); needs tool_call_parser, as in vLLM."""
    api_processes: int | None = setting(None, integer(0, 64, nullable=True))
    """HTTP frontend processes (vLLM's --api-server-count), 0..64: 0 serves HTTP in rank 0's own process,
    N >= 1 runs N frontends beside rank 0's engine loop; None: 1 (as vLLM)."""
    log_stats_interval_s: float = setting(10.0, number("a number in [0, 86400]", lambda v: 0.0 <= v <= 86400.0))
    """Seconds between the engine's activity lines in the log (prefill and generated tokens a second, running and
    waiting requests, KV cache use, prefix cache hits, preemptions), written for intervals with work; 0: none."""
    data_parallel_routing: str = setting("cache_aware", choice("cache_aware", "round_robin"))
    """With data_parallel_size > 1: "cache_aware" sends a request to the replica most likely to hold its prompt's
    prefix, balanced against the replicas' loads (rtp/server/router.py); "round_robin" ignores the caches."""

    @classmethod
    def joint_rule(cls, values: Mapping[str, Any], key_of: Callable[[str], str]) -> tuple[str, str] | None:
        if values["default_max_tokens"] > values["max_tokens_limit"]:
            return "default_max_tokens", f"an integer <= {key_of('max_tokens_limit')}={values['max_tokens_limit']}"
        return None


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")
"""Methods ``speculative_config.method`` accepts (vLLM's names)."""

IMPLEMENTED_SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig(Section):
    """Speculative decoding (vLLM's ``speculative_config``): a proposer drafts tokens, the model verifies
    them in one step, and the output is exactly what decoding without it gives (greedy: the same tokens;
    sampled: the same distribution, and with a seed the same tokens)."""

    flat: ClassVar[bool] = False  # always under `speculative_config:`

    method: str | None = setting(None, choice(*SPECULATIVE_METHODS, nullable=True))
    """"ngram" (prompt lookup over prompt + output), "draft_model" (a small Qwen3 with the target's
    tokenizer), "eagle3" (an EAGLE-3 head over the target's hidden states), or None: no speculation."""
    num_speculative_tokens: int | None = setting(None, integer(1, 64, nullable=True))
    """Most draft tokens per sequence and step, in [1, 64]; required with a method."""
    prompt_lookup_min: int | None = setting(None, integer(1, 64, nullable=True))
    """ngram: shortest suffix of the context that must recur earlier for a draft, in [1, 64]; None: 2, or
    prompt_lookup_max when only that is given and smaller."""
    prompt_lookup_max: int | None = setting(None, integer(1, 64, nullable=True))
    """ngram: longest suffix matched, in [prompt_lookup_min, 64]; None: max(prompt_lookup_min, 5)."""
    model: str | None = setting(None, text("a checkpoint folder path", nullable=True))
    """draft_model: the draft checkpoint folder (same vocabulary and tokenizer as the target); eagle3: the
    head's folder (SpecForge or speculators format); required with either."""
    draft_tensor_parallel_size: int | None = setting(None, integer(1, nullable=True))
    """draft_model: ranks the draft runs on; None or 1: rank 0 alone (the only one implemented yet; the
    target's TP size fails at start as not implemented, any other value as invalid)."""
    disable_by_batch_size: int | None = setting(16, integer(1, nullable=True))
    """No drafts in a step while more than this many sequences run (verifying k drafts costs k + 1 query
    tokens per sequence, which a large batch pays for without gaining latency), >= 1; None: never."""
    min_acceptance_rate: float = setting(0.1, number("a number in [0, 1]", lambda v: 0.0 <= v <= 1.0))
    """A sequence whose drafts were accepted at less than this rate (over its recent drafts) stops
    drafting and tries again later, in [0, 1]; 0 never stops."""

    @classmethod
    def joint_rule(cls, values: Mapping[str, Any], key_of: Callable[[str], str]) -> tuple[str, str] | None:
        method = values["method"]
        if method is None:  # the method's own keys without one: refused rather than no speculation unsaid
            given = [k for k in ("num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
                     if values[k] is not None]
            if given:
                return "method", (f"one of {', '.join(IMPLEMENTED_SPECULATIVE_METHODS)} with "
                                  f"{key_of(given[0])}={values[given[0]]!r} (without a method nothing is speculated)")
            return None
        if method == "ngram" and values["model"] is not None:
            return "model", f"None with {key_of('method')}='ngram' (prompt lookup drafts from the context, no model)"
        if method not in IMPLEMENTED_SPECULATIVE_METHODS:
            return "method", ("one of " + ", ".join(IMPLEMENTED_SPECULATIVE_METHODS)
                              + f" ('{method}' is not implemented yet)")
        if values["num_speculative_tokens"] is None:
            return "num_speculative_tokens", f"an integer in [1, 64] with {key_of('method')}={method!r}"
        if method in ("draft_model", "eagle3") and values["model"] is None:
            return "model", f"a draft checkpoint folder path with {key_of('method')}={method!r}"
        lo, hi = values["prompt_lookup_min"], values["prompt_lookup_max"]
        if lo is not None and hi is not None and lo > hi:
            return "prompt_lookup_max", f"an integer >= {key_of('prompt_lookup_min')}={lo}"
        return None

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(shortest, longest) suffix the ngram proposer matches, defaults filled in."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None:
            lo = 2 if hi is None else min(2, hi)
        if hi is None:
            hi = max(lo, 5)
        return lo, hi

    @property
    def enabled(self) -> bool:
        """True when a method is set."""
        return self.method is not None


@dataclass(frozen=True)
class RtpConfig(Section):
    """Everything a run needs besides the prompts, in sections: model, parallel, cache, scheduler, liveness,
    server."""

    model: ModelConfig = section(ModelConfig)
    """The checkpoint, dtype, longest sequence, CUDA graphs, seed (``model:`` mapping in YAML)."""
    parallel: ParallelConfig = section(ParallelConfig)
    """Tensor parallelism, device, the step-plan ring (``parallel:``)."""
    cache: CacheConfig = section(CacheConfig)
    """The KV cache (``cache:``)."""
    scheduler: SchedulerConfig = section(SchedulerConfig)
    """Batch limits (``scheduler:``)."""
    liveness: LivenessConfig = section(LivenessConfig)
    """Hung-rank and stuck-step bounds (``liveness:``)."""
    server: ServerConfig = section(ServerConfig)
    """HTTP server settings (``server:``)."""
    speculative_config: SpeculativeConfig = section(SpeculativeConfig)
    """Speculative decoding (``speculative_config:``, as vLLM spells it); off by default."""
    log_level: str = setting("INFO", choice("DEBUG", "INFO", "WARNING", "ERROR", fold_case=True))
    """Log level of rank 0: DEBUG, INFO, WARNING or ERROR (other ranks log warnings and errors only)."""


# --------------------------------------------------------------------------- checking


def section_fields() -> dict[str, type[Section]]:
    """Section name -> its class, in :class:`RtpConfig` order."""
    return {f.name: f.metadata["section"] for f in fields(RtpConfig) if "section" in f.metadata}


def flat_keys() -> dict[str, str]:
    """Top-level YAML key -> the dotted key it stands for ("block_size" -> "cache.block_size")."""
    out: dict[str, str] = {}
    for name, cls in section_fields().items():
        if cls.flat:
            for f in fields(cls):
                out[f.metadata.get("flat", f.name)] = f"{name}.{f.name}"
    return out


def setting_keys() -> list[str]:
    """Every setting's dotted key ("cache.block_size", ..., "log_level"), in declaration order."""
    out: list[str] = []
    for f in fields(RtpConfig):
        cls = f.metadata.get("section")
        out += [f"{f.name}.{g.name}" for g in fields(cls)] if cls else [f.name]
    return out


def value_of(config: RtpConfig, key: str) -> Any:
    """The value of setting ``key``, dotted ("cache.block_size") or flat ("block_size")."""
    value: Any = config
    for part in flat_keys().get(key, key).split("."):
        value = getattr(value, part)
    return value


def validated(cls: type[Section], given: Mapping[str, Given]) -> dict[str, Any]:
    """Check the fields of ``cls`` in ``given`` (defaults for the others) plus its joint rule; normalised values."""
    out: dict[str, Any] = {}
    keys: dict[str, Given] = {}
    for f in fields(cls):
        g = given.get(f.name) or Given(_field_default(f), f.name, cls.__name__)
        keys[f.name] = g
        sub = f.metadata.get("section")
        out[f.name] = section_value(sub, g) if sub else check_value(rule_of(f), g.key, g.value, g.source)
    broken = cls.joint_rule(out, lambda name: keys[name].key)
    if broken is not None:
        name, allowed = broken
        g = keys[name]
        raise ConfigError(f"{g.source}: {g.key}={short_repr(out[name])} is invalid: expected {allowed}")
    return out


def section_value(cls: type[Section], g: Given) -> Section:
    """The section ``cls`` that ``g`` gives: None (its defaults), an instance, or a mapping of its fields."""
    if g.value is None:
        return cls()
    if isinstance(g.value, cls):
        return g.value
    if isinstance(g.value, Mapping):
        return parse_section(cls, g.value, g.key, lambda _key: g.source)
    allowed = ", ".join(f.name for f in fields(cls))
    raise ConfigError(f"{g.source}: {g.key}={short_repr(g.value)} is invalid: "
                      f"expected a mapping with keys among {allowed} (got {type_name(g.value)})")


def section_settings(cls: type[Section], data: Mapping[Any, Any], name: str,
                     source_of: Callable[[str], str]) -> dict[str, Given]:
    """The fields that ``data``, the mapping under section ``name``, gives; ConfigError for a key ``cls`` lacks."""
    names = {f.name for f in fields(cls)}
    given: dict[str, Given] = {}
    for key, value in data.items():
        dotted = f"{name}.{key}"
        if not isinstance(key, str) or key not in names:
            raise unknown_section_key(cls, name, key, source_of(dotted))
        given[key] = Given(value, dotted, source_of(dotted))
    return given


def parse_section(cls: type[Section], data: Mapping[Any, Any], name: str, source_of: Callable[[str], str]) -> Any:
    """Build section ``cls`` from the YAML mapping under ``name`` (``source_of(dotted key)`` names its origin)."""
    return cls(**validated(cls, section_settings(cls, data, name, source_of)))


def unknown_section_key(cls: type[Section], name: str, key: Any, source: str) -> ConfigError:
    """The error for ``key`` under section ``name``: a renamed key names its new spelling, a typo a close one."""
    allowed = [f.name for f in fields(cls)]
    where = f"{name}.{key}" if isinstance(key, str) else f"{name}.{key!r}"
    flat = flat_keys()
    hint = ""
    if isinstance(key, str):
        renamed = flat.get(key, "")
        if renamed.startswith(name + ".") and renamed != f"{name}.{key}":
            return ConfigError(f"{source}: '{where}' was renamed to '{renamed}' "
                               f"(the top-level '{key}' is accepted too)")
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        if close:
            hint = f" (did you mean '{name}.{close[0]}'?)"
        elif key in flat:
            hint = f" (did you mean '{key}' (or '{flat[key]}')? it is not a {name} setting)"
        elif key == "server" or key in {f.name for f in fields(ServerConfig)}:
            hint = f" (did you mean 'server.{key}'? it is not a {name} setting)"
    return ConfigError(f"{source}: unknown key '{where}'{hint}; allowed keys under {name}: {', '.join(allowed)}")


def _field_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    raise TypeError(f"config field {f.name} has no default")
