"""Every config key as a command-line flag, spelled as vLLM spells it where vLLM has the setting.

    rtp serve MODEL --tensor-parallel-size 2 --dtype float32 --max-num-seqs 32 --no-enable-prefix-caching

A flag overrides the YAML (``--config``); a flag that is not given changes nothing. Values are
checked before any rank starts: argparse checks the type (``--max-num-seqs x``), then
:func:`load_config_from_args` checks each flag's value against the config's rules on its own, so the
one-line error names the flag (``--max-num-seqs=0 is invalid: expected an integer >= 1``), and last the
whole config (rules that join keys). Keys vLLM has no flag for keep rtp's own name in the same style
(``--cpu-kv-cache-gib``, ``--liveness-timeout-s``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rtp.config import RtpConfig, default_config_path, load_config
from rtp.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Flag:
    """One config setting on the command line: ``key`` is its dotted key ("cache.block_size", "server.port")."""

    key: str
    names: tuple[str, ...]
    type: Callable[[str], Any] | None  # None: a boolean with its --no- form
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def _json_mapping(value: str) -> dict[str, Any]:
    """A JSON object given on the command line (``--speculative-config '{"method": "ngram", ...}'``)."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {value!r}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return data


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("parallel.tensor_parallel_size", ("--tensor-parallel-size", "-tp"), int,
         "ranks each pipeline stage (or data-parallel replica) is split over; `rtp serve` starts TP x PP (or "
         "DP x TP) ranks (default: torchrun's world size / PP / DP)"),
    Flag("parallel.data_parallel_size", ("--data-parallel-size", "-dp"), int,
         "independent replicas behind one server, each over --tensor-parallel-size ranks (`rtp serve` starts "
         "DP x TP ranks)"),
    Flag("parallel.data_parallel_size_local", ("--data-parallel-size-local", "-dpl"), int,
         "replicas on this node (torchrun --nnodes: each node's ranks / TP); a cross-check, default: derived"),
    Flag("parallel.pipeline_parallel_size", ("--pipeline-parallel-size", "-pp"), int,
         "pipeline stages (contiguous layer ranges; TP ranks each), default 1"),
    Flag("parallel.pipeline_layer_partition", ("--pipeline-layer-partition",), str,
         "layers per stage, comma-separated (e.g. 13,14,14,13); default: an even split"),
    Flag("parallel.pipeline_steps_in_flight", ("--pipeline-steps-in-flight",), int,
         "steps in flight with pipeline stages, over disjoint requests (default: the stage count; 1: one at a time)"),
    Flag("parallel.device", ("--device",), str, "auto (cuda when available), cpu or cuda", ("auto", "cpu", "cuda")),
    Flag("model.dtype", ("--dtype",), str, "auto (bfloat16 on cuda and on CPUs with AVX-512 BF16 or AMX, else "
         "float32), float32, bfloat16, float16 (vLLM's half, float, bf16 accepted)",
         metavar="{auto,float32,bfloat16,float16}"),
    Flag("model.quantization", ("--quantization",), str,
         "int8: int8 projections and LM head, quantized at load (CPU decode); quantized checkpoints need none",
         ("int8",)),
    Flag("cache.block_size", ("--block-size",), int, "tokens per KV block, a power of two in 1..1024"),
    Flag("scheduler.max_num_seqs", ("--max-num-seqs",), int, "most sequences running at once"),
    Flag("scheduler.max_num_batched_tokens", ("--max-num-batched-tokens",), int, "most query tokens in one step"),
    Flag("model.max_model_len", ("--max-model-len",), int, "longest prompt + completion (default: the model's)"),
    Flag("cache.enable_prefix_caching", ("--enable-prefix-caching",), None, "reuse KV blocks of identical prefixes"),
    Flag("parallel.expert_parallel", ("--enable-expert-parallel", "-ep"), None, "MoE: whole experts per rank"),
    Flag("cache.gpu_memory_utilization", ("--gpu-memory-utilization",), float,
         "fraction of each GPU's memory rtp may use, in (0, 1]"),
    Flag("cache.num_kv_blocks", ("--num-gpu-blocks-override", "--num-kv-blocks"), int,
         "fixed number of KV blocks per rank instead of the memory-based sizing"),
    Flag("cache.cpu_kv_cache_gib", ("--cpu-kv-cache-gib",), float, "KV cache per rank on CPU, in GiB"),
    Flag("cache.kv_cache_dtype", ("--kv-cache-dtype",), str,
         "auto (the model's dtype) or fp8_e4m3 (one byte per element, per-layer scales; vLLM's fp8 accepted)",
         metavar="{auto,fp8_e4m3}"),
    Flag("model.enforce_eager", ("--enforce-eager",), None, "no CUDA graphs"),
    Flag("model.batch_invariant", ("--batch-invariant",), None,
         "a request's tokens do not depend on the rest of the batch (CPU)"),
    Flag("model.cuda_graph_max_batch", ("--max-cudagraph-capture-size",), int, "largest decode batch in a CUDA graph"),
    Flag("parallel.shm_chunk_bytes", ("--shm-chunk-bytes",), int, "bytes per chunk of the step-plan ring"),
    Flag("parallel.shm_num_chunks", ("--shm-num-chunks",), int, "chunks of the step-plan ring"),
    Flag("liveness.timeout_s", ("--liveness-timeout-s",), float, "seconds without a heartbeat before a rank is hung"),
    Flag("liveness.step_timeout_s", ("--step-timeout-s",), float,
         "seconds one step may run before it is reported stuck"),
    Flag("model.generation_config", ("--generation-config",), str,
         "auto: the checkpoint's generation_config.json sampling settings are request defaults; none (vLLM's "
         "vllm accepted): rtp's", metavar="{auto,none}"),
    Flag("model.seed", ("--seed",), int, "seed of the default random generator"),
    Flag("speculative_config", ("--speculative-config",), _json_mapping,
         'speculative decoding as a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
         metavar="JSON"),
    Flag("log_level", ("--log-level",), str.upper, "log level of rank 0", ("DEBUG", "INFO", "WARNING", "ERROR"),
         metavar="{DEBUG,INFO,WARNING,ERROR}"),
)

SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("server.host", ("--host",), str, "address to listen on"),
    Flag("server.port", ("--port",), int, "TCP port, 0 for a free one"),
    Flag("server.api_key", ("--api-key",), str, "require 'Authorization: Bearer KEY' (default: $RTP_API_KEY)"),
    Flag("server.served_model_name", ("--served-model-name",), str, "model name in the API (default: the folder's)"),
    Flag("server.max_request_bytes", ("--max-request-bytes",), int, "larger request bodies get a 413"),
    Flag("server.max_tokens_limit", ("--max-tokens-limit",), int, "upper bound on a request's max_tokens"),
    Flag("server.default_max_tokens", ("--default-max-tokens",), int, "max_tokens of a request that gives none"),
    Flag("server.shutdown_grace_s", ("--shutdown-timeout",), float,
         "on SIGTERM, seconds running requests may take to finish"),
    Flag("server.reasoning_parser", ("--reasoning-parser",), str,
         "split <think>...</think> of chat outputs into reasoning_content", ("qwen3",)),
    Flag("server.tool_call_parser", ("--tool-call-parser",), str, "parse Qwen3's <tool_call> blocks into tool_calls",
         ("hermes", "qwen3")),
    Flag("server.enable_auto_tool_choice", ("--enable-auto-tool-choice",), None,
         'allow tool_choice "auto", the default with tools; needs --tool-call-parser'),
    Flag("server.api_processes", ("--api-server-count", "--api-processes"), int,
         "HTTP frontend processes beside the engine; 0 serves HTTP in rank 0's process (default: by core count)"),
    Flag("server.log_stats_interval_s", ("--log-stats-interval",), float,
         "seconds between the engine's activity lines in the log (throughput, requests, KV cache); 0: none"),
    Flag("server.data_parallel_routing", ("--data-parallel-routing",), str,
         "with --data-parallel-size > 1: cache_aware (the replica holding the prompt's prefix, balanced by load) "
         "or round_robin", ("cache_aware", "round_robin")),
)


def _dest(flag: Flag) -> str:
    return flag.key.replace(".", "__")


def add_flags(ap: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    """Add ``flags`` to ``ap``; each defaults to None (not given: the YAML's value stands)."""
    for flag in flags:
        help_text = f"{flag.help} (config: {flag.key})"
        if flag.type is None:
            ap.add_argument(*flag.names, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None,
                            help=help_text)
        else:
            # The setting's own name (PORT, BLOCK_SIZE), not the dest argparse would show; choices show themselves.
            metavar = flag.metavar or (None if flag.choices else flag.key.rpartition(".")[2].upper())
            ap.add_argument(*flag.names, dest=_dest(flag), type=flag.type, choices=flag.choices, default=None,
                            metavar=metavar, help=help_text)


def given(args: argparse.Namespace, flags: Sequence[Flag]) -> list[tuple[Flag, Any]]:
    """The flags of ``flags`` given on the command line, with their values."""
    return [(f, getattr(args, _dest(f))) for f in flags if getattr(args, _dest(f), None) is not None]


def overrides(pairs: Sequence[tuple[Flag, Any]]) -> dict[str, Any]:
    """``load_config`` keyword overrides for flag values: a mapping per section, top-level keys as they are."""
    out: dict[str, Any] = {}
    for flag, value in pairs:
        section, _, name = flag.key.rpartition(".")
        if section:
            out.setdefault(section, {})[name] = value
        else:
            out[name] = value
    return out


_INVALID = re.compile(r"^\S+: \S+=.* is invalid: (.*)$")


def _flag_error(flag: Flag, value: Any, error: ConfigError) -> ConfigError:  # noqa: ANN401
    if isinstance(value, dict):  # a section given as JSON: the error names the key inside it
        return ConfigError(f"{flag.names[0]}: {str(error).removeprefix('override: ')}")
    shown = str(value).lower() if isinstance(value, bool) else value
    if flag.key == "server.api_key":
        shown = "<hidden>"  # a key never goes to a log
    m = _INVALID.match(str(error))
    why = f"expected {m.group(1).removeprefix('expected ')}" if m else str(error)
    return ConfigError(f"{flag.names[0]}={shown} is invalid: {why}")


def load_config_from_args(args: argparse.Namespace, flags: Sequence[Flag], **extra: Any) -> RtpConfig:
    """The config of ``args.config`` (default: configs/cpu.yaml) with ``args.model`` and every given flag applied.

    ``extra`` are further overrides (None values ignored). Raises ConfigError naming the flag whose
    value the config refuses, else naming the key (a bad YAML value, or a rule joining several keys).
    """
    path = args.config or default_config_path()
    pairs = given(args, flags)
    if pairs:
        load_config(path)  # the file's own errors name the file
    for flag, value in pairs:  # then one flag at a time: an error here is this flag's
        try:
            load_config(path, **overrides([(flag, value)]))
        except ConfigError as e:
            raise _flag_error(flag, value, e) from None
    merged = overrides(pairs)
    for key, value in extra.items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update({k: v for k, v in value.items() if v is not None})
        elif value is not None:
            merged[key] = value
    if args.model is not None:
        merged.setdefault("model", {})["path"] = args.model
    return load_config(path, **merged)


def api_key_from_env(args: argparse.Namespace) -> None:
    """``--api-key`` falls back to $RTP_API_KEY (which stays out of the process list)."""
    if getattr(args, "server__api_key", None) is None and os.environ.get("RTP_API_KEY"):
        args.server__api_key = os.environ["RTP_API_KEY"]


def add_model_argument(ap: argparse.ArgumentParser) -> None:
    """``rtp serve MODEL``: the checkpoint as a positional argument, as ``vllm serve MODEL`` takes it."""
    ap.add_argument("model_tag", nargs="?", metavar="MODEL", help="HF Qwen3 checkpoint folder (same as --model)")


def resolve_model_argument(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Merge the positional MODEL into ``args.model``; two different models are an error."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and os.path.normpath(args.model) != os.path.normpath(tag):
        ap.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag
