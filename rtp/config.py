"""Typed, validated configuration: dataclasses, YAML loading, clear errors.

The config is loaded and validated once, at the edge (``launch/`` or
``rtp.init``). Every bad value raises :class:`rtp.errors.ConfigError` with one
line that names the source (a file, ``override`` or the class), the key, the
bad value and what is allowed::

    configs/x.yaml: block_size=-3 is invalid: expected a power of two between 1 and 1024

Values derived from the config (number of KV blocks, eos id, resolved dtype)
belong to runtime objects; they are never written back into these frozen
dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from rtp.errors import ConfigError
from rtp.log import get_logger

logger = get_logger(__name__)

OVERRIDE_SOURCE = "override"
"""Source named in errors about values passed to :func:`load_config` as keyword overrides."""


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the OpenAI-compatible HTTP server (rank 0 only)."""

    host: str = "127.0.0.1"
    """Address to listen on; the default serves the local machine only (use 0.0.0.0 to expose it)."""
    port: int = 8000
    """TCP port, 0..65535; 0 lets the OS pick a free port."""
    # repr=False: the key must never end up in a log line through repr(config).
    api_key: str | None = field(default=None, repr=False)
    """When set, every endpoint but /health needs the header "Authorization: Bearer <key>"."""
    served_model_name: str | None = None
    """Model name reported by /v1/models and accepted in requests; None means the model folder's name."""
    max_request_bytes: int = 1 << 20
    """Request bodies larger than this many bytes are rejected with HTTP 413."""
    max_tokens_limit: int = 4096
    """Upper bound on a request's max_tokens."""
    default_max_tokens: int = 256
    """max_tokens used when a request gives none; at most max_tokens_limit."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, seconds that running requests may take to finish before they are aborted."""
    reasoning_parser: str | None = None
    """"qwen3" splits chat outputs' <think>...</think> into reasoning_content (vLLM's --reasoning-parser)."""
    tool_call_parser: str | None = None
    """"hermes" (or its alias "qwen3") parses <tool_call> blocks into tool_calls (vLLM's --tool-call-parser)."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice "auto" (the default with tools); needs tool_call_parser, as in vLLM."""

    def __post_init__(self) -> None:
        _validate_instance(self)


@dataclass(frozen=True)
class RtpConfig:
    """Everything a run needs besides the prompts: model, parallelism, memory, scheduling."""

    model: str | None = None
    """Hugging Face checkpoint folder; None means the small trained Qwen3 shipped in ``rtp/assets``."""
    tensor_parallel_size: int | None = None
    """Number of ranks a model is split over; None means torchrun's WORLD_SIZE (GPU topology files fix it)."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    dtype: str = "auto"
    """"auto" (bfloat16 on cuda and on CPUs with AVX-512 BF16 or AMX, else float32), "float32", "bfloat16",
    "float16"."""
    block_size: int | None = None
    """Tokens per KV block; a power of two in 1..1024, or None for 256 with flash-attn and 16 otherwise.

    flash-attn's paged path needs a multiple of 256; the runtime checks that on CUDA.
    """
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_num_batched_tokens: int = 8192
    """Most query tokens in one step; chunked prefill splits longer prompts."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; None means the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    expert_parallel: bool = False
    """MoE models only: each rank holds num_experts / TP whole experts instead of a 1/TP slice of each."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU's memory that weights, activations and the KV cache may use, in (0, 1]."""
    num_kv_blocks: int | None = None
    """Fixed number of KV blocks per rank, overriding the memory-based sizing."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size per rank on CPU, in GiB."""
    enforce_eager: bool = False
    """True disables CUDA graphs (every decode step runs eagerly)."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch captured in a CUDA graph; larger batches run eagerly."""
    shm_chunk_bytes: int = 1 << 20
    """Size of one chunk of the shared-memory ring that carries step plans; larger messages span chunks."""
    shm_num_chunks: int = 4
    """Number of chunks in the shared-memory ring."""
    liveness_timeout_s: float = 10.0
    """Seconds without a heartbeat after which a rank is declared hung, in (0, 3600].

    Every rank's heartbeat thread beats ten times per timeout, also during long
    steps and compiles; a stopped, swapped-out or driver-stuck process stops
    beating and is caught within this bound plus about a second. A rank whose
    process exits is noticed within about a second whatever this is.
    Collectives time out after max(this, 60) seconds (startup skew between ranks).
    """
    step_timeout_s: float | None = 300.0
    """Seconds one step may run before it is reported as stuck, in (0, 86400], or null for no limit.

    A stuck step makes every rank dump its Python stacks to the log and fails
    the run with an error naming the ranks that had not finished it. Leave room
    for the longest prefill chunk and for first-step compiles.
    """
    seed: int = 0
    """Seed of the default random generator (requests may bring their own)."""
    log_level: str = "INFO"
    """Log level of rank 0: DEBUG, INFO, WARNING or ERROR (other ranks log warnings and errors only)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """HTTP server settings (the `server:` mapping in YAML)."""

    def __post_init__(self) -> None:
        _validate_instance(self)


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class _Rule:
    """How one field is checked: its kind, an optional range test and the text naming what is allowed."""

    kind: str  # "int" | "float" | "bool" | "str" | "choice" | "section"
    allowed: str  # completes "expected ...", e.g. "an integer >= 1"
    ok: Callable[[Any], bool] | None = None
    nullable: bool = False
    choices: tuple[str, ...] = ()
    fold_case: bool = False  # compare choices case-insensitively and store the canonical spelling


def _int(lo: int, hi: int | None = None, nullable: bool = False) -> _Rule:
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    ok = (lambda v: v >= lo) if hi is None else (lambda v: lo <= v <= hi)
    return _Rule("int", text + (" or null" if nullable else ""), ok, nullable)


def _str(allowed: str, nullable: bool = False) -> _Rule:
    return _Rule("str", allowed + (" or null" if nullable else ""), nullable=nullable)


def _choice(*choices: str, fold_case: bool = False) -> _Rule:
    return _Rule("choice", "one of " + ", ".join(choices), choices=choices, fold_case=fold_case)


_BOOL = _Rule("bool", "true or false")

_RULES: dict[type, dict[str, _Rule]] = {
    ServerConfig: {
        "host": _str("a non-empty host name or IP address"),
        "port": _int(0, 65535),
        "api_key": _str("a non-empty string", nullable=True),
        "served_model_name": _str("a non-empty string", nullable=True),
        "max_request_bytes": _int(1),
        "max_tokens_limit": _int(1),
        "default_max_tokens": _int(1),
        "shutdown_grace_s": _Rule("float", "a number in [0, 86400]", lambda v: 0.0 <= v <= 86400.0),
        "reasoning_parser": _Rule("choice", "qwen3 or null", choices=("qwen3",), nullable=True),
        "tool_call_parser": _Rule("choice", "one of hermes, qwen3 or null", choices=("hermes", "qwen3"),
                                  nullable=True),
        "enable_auto_tool_choice": _BOOL,
    },
    RtpConfig: {
        "model": _str("a checkpoint folder path", nullable=True),
        "tensor_parallel_size": _int(1, nullable=True),
        "device": _choice("auto", "cpu", "cuda"),
        "dtype": _choice("auto", "float32", "bfloat16", "float16"),
        "block_size": _Rule(
            "int", "a power of two between 1 and 1024 or null", lambda v: 1 <= v <= 1024 and v & (v - 1) == 0,
            nullable=True,
        ),
        "max_num_seqs": _int(1),
        "max_num_batched_tokens": _int(1),
        "max_model_len": _int(1, nullable=True),
        "enable_prefix_caching": _BOOL,
        "expert_parallel": _BOOL,
        "gpu_memory_utilization": _Rule("float", "a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
        "num_kv_blocks": _int(1, nullable=True),
        "cpu_kv_cache_gib": _Rule("float", "a number > 0", lambda v: v > 0.0),
        "enforce_eager": _BOOL,
        "cuda_graph_max_batch": _int(1),
        "shm_chunk_bytes": _int(4096),
        "shm_num_chunks": _int(2),
        "liveness_timeout_s": _Rule("float", "a number in (0, 3600]", lambda v: 0.0 < v <= 3600.0),
        "step_timeout_s": _Rule("float", "a number in (0, 86400] or null", lambda v: 0.0 < v <= 86400.0,
                                nullable=True),
        "seed": _int(0, 2**63 - 1),
        "log_level": _choice("DEBUG", "INFO", "WARNING", "ERROR", fold_case=True),
        "server": _Rule("section", "a mapping of server settings"),
    },
}

# Sources are looked up per dotted key so that a merged file + overrides config
# names the right origin of each bad value.
_SourceOf = Callable[[str], str]


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)  # repr escapes newlines, so the message stays on one line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    names = {
        bool: "a boolean", int: "an integer", float: "a number",
        str: "a string", list: "a list", dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def _invalid(source: str, key: str, value: Any, rule: _Rule, got_type: bool = False) -> ConfigError:
    suffix = f" (got {_type_name(value)})" if got_type else ""
    return ConfigError(f"{source}: {key}={_short_repr(value)} is invalid: expected {rule.allowed}{suffix}")


def _check_value(rule: _Rule, key: str, value: Any, source: str) -> Any:
    """Return ``value`` normalised (int -> float, canonical choice spelling) or raise ConfigError."""
    if value is None:
        if rule.nullable:
            return None
        raise _invalid(source, key, value, rule)
    if rule.kind == "bool":
        if not isinstance(value, bool):
            raise _invalid(source, key, value, rule, got_type=True)
        return value
    if rule.kind == "int":
        # bool is a subclass of int, but `block_size: true` is a mistake, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(source, key, value, rule, got_type=True)
    elif rule.kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _invalid(source, key, value, rule, got_type=True)
        value = float(value)
        if not math.isfinite(value):
            raise _invalid(source, key, value, rule)
    elif rule.kind == "str":
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _invalid(source, key, value, rule, got_type=True)
        if not value.strip():
            raise _invalid(source, key, value, rule)
    elif rule.kind == "choice":
        if not isinstance(value, str):
            raise _invalid(source, key, value, rule, got_type=True)
        lookup = {(c.upper() if rule.fold_case else c): c for c in rule.choices}
        canonical = lookup.get(value.upper() if rule.fold_case else value)
        if canonical is None:
            raise _invalid(source, key, value, rule)
        return canonical
    if rule.ok is not None and not rule.ok(value):
        raise _invalid(source, key, value, rule)
    return value


def _unknown_key(cls: type, prefix: str, key: Any, source: str) -> ConfigError:
    allowed = list(_RULES[cls])
    where = f"{prefix}{key}" if isinstance(key, str) else f"{prefix}{key!r}"
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        if close:
            hint = f" (did you mean '{prefix}{close[0]}'?)"
        elif cls is RtpConfig and key in _RULES[ServerConfig]:
            hint = f" (did you mean 'server.{key}'? server settings go under a `server:` mapping)"
        elif cls is ServerConfig and key in _RULES[RtpConfig]:
            hint = f" (did you mean '{key}'? it is a top-level setting, not a server one)"
    scope = " under server" if prefix else ""
    return ConfigError(f"{source}: unknown key '{where}'{hint}; allowed keys{scope}: {', '.join(allowed)}")


def _parse_section(cls: type, data: Any, prefix: str, source_of: _SourceOf) -> Any:
    """Check a mapping of ``cls`` fields (missing ones take defaults) and build ``cls``."""
    rules = _RULES[cls]
    for key in data:
        if not isinstance(key, str) or key not in rules:
            raise _unknown_key(cls, prefix, key, source_of(f"{prefix}{key}"))
    values = {f.name: _field_default(f) for f in fields(cls)}
    values.update(data)
    return cls(**_validate_values(cls, values, prefix, source_of))


def _validate_values(cls: type, values: dict[str, Any], prefix: str, source_of: _SourceOf) -> dict[str, Any]:
    """Check every field of ``cls`` in ``values`` plus the cross-field rules; return normalised values."""
    out: dict[str, Any] = {}
    for name, rule in _RULES[cls].items():
        key = prefix + name
        value = values[name]
        if rule.kind == "section":
            if value is None:
                value = ServerConfig()
            elif isinstance(value, Mapping):
                value = _parse_section(ServerConfig, value, key + ".", source_of)
            elif not isinstance(value, ServerConfig):
                allowed = ", ".join(_RULES[ServerConfig])
                raise ConfigError(
                    f"{source_of(key)}: {key}={_short_repr(value)} is invalid: "
                    f"expected a mapping with keys among {allowed} (got {_type_name(value)})"
                )
            out[name] = value
        else:
            out[name] = _check_value(rule, key, value, source_of(key))
    if cls is ServerConfig and out["default_max_tokens"] > out["max_tokens_limit"]:
        key = prefix + "default_max_tokens"
        raise ConfigError(
            f"{source_of(key)}: {key}={out['default_max_tokens']} is invalid: expected an integer "
            f"<= {prefix}max_tokens_limit={out['max_tokens_limit']}"
        )
    return out


def _validate_instance(obj: Any) -> None:
    """Validate a directly constructed config; normalise fields in place (they are frozen)."""
    cls = type(obj)
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    normalised = _validate_values(cls, values, "", lambda _key: cls.__name__)
    for name, value in normalised.items():
        if value is not values[name]:
            object.__setattr__(obj, name, value)


def _field_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    raise TypeError(f"config field {f.name} has no default")


# --------------------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, source: str) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        shipped = default_config_path()
        hint = ""
        if shipped is not None:
            names = sorted(p.name for p in shipped.parent.glob("*.yaml"))
            hint = f" (shipped configs in {shipped.parent}: {', '.join(names)})"
        raise ConfigError(f"{source}: config file not found{hint}") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: is not UTF-8 text, expected a YAML file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        raise ConfigError(f"{source}: cannot read the config file: {reason}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:  # an empty file (or only comments): every default
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: the top level must be a mapping of settings (key: value), got {_type_name(data)}; "
            f"allowed keys: {', '.join(_RULES[RtpConfig])}"
        )
    return data


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> RtpConfig:
    """Build and validate an :class:`RtpConfig` from a mapping (a nested ``server`` mapping allowed)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings, got {_type_name(data)}")
    return _parse_section(RtpConfig, data, "", lambda _key: source)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> RtpConfig:
    """Load ``path`` (None: the built-in defaults), apply ``overrides`` and validate once.

    ``overrides`` are top-level keys (``block_size=32``) plus ``server=`` a
    mapping merged into the file's ``server`` mapping. Overrides whose value is
    None are ignored, so command-line flags that were not given change nothing;
    errors about an override name the source ``override``.
    """
    source = "<defaults>" if path is None else os.fspath(path)
    data: dict[str, Any] = {} if path is None else dict(_read_yaml(Path(path), source))
    overridden: set[str] = set()
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "server" and isinstance(value, (Mapping, ServerConfig)):
            given = dict(value) if isinstance(value, Mapping) else dataclasses.asdict(value)
            base = data.get("server")
            if base is not None and not isinstance(base, Mapping):
                continue  # the file's own bad `server:` value is reported below, with the file as source
            merged = dict(base or {})
            for sub_key, sub_value in given.items():
                if sub_value is not None:
                    merged[sub_key] = sub_value
                    overridden.add(f"server.{sub_key}")
            data["server"] = merged
        else:
            data[key] = value
            overridden.add(key)

    def source_of(key: str) -> str:
        return OVERRIDE_SOURCE if key in overridden else source

    config = _parse_section(RtpConfig, data, "", source_of)
    logger.debug("loaded config from %s with overrides %s", source, sorted(overridden))
    return config


def default_config_path() -> Path | None:
    """The repository's ``configs/cpu.yaml``, or None when it is not shipped (an installed wheel).

    ``load_config(default_config_path())`` therefore falls back to the built-in
    defaults when the file is missing.
    """
    path = Path(__file__).resolve().parent.parent / "configs" / "cpu.yaml"
    return path if path.is_file() else None


def resolve_tp_size(config: RtpConfig, world_size: int) -> int:
    """The tensor-parallel size of this run: ``tensor_parallel_size`` if set (it must equal world_size)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world size {world_size!r} is invalid: expected an integer >= 1")
    tp = config.tensor_parallel_size
    if tp is None:
        return world_size
    if tp != world_size:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not match the {world_size} rank{'s' if world_size != 1 else ''} "
            "started by torchrun: "
            f"run `torchrun --nproc-per-node {tp} ...` "
            f"or change tensor_parallel_size to {world_size} (or null)"
        )
    return tp
