"""rtp: a small multi-process tensor-parallel inference runtime for Qwen3.

Run under ``torchrun --nproc-per-node N``. ``rtp.init()`` returns on rank 0
only; worker ranks serve steps inside it and exit the process when rank 0
calls ``rtp.shutdown()`` (or exits). With ``data_parallel_size`` > 1 the other
replicas' coordinators also stay inside: they run the shares of each
``rtp.generate()`` batch that rank 0 sends them. The module keeps the one current runtime
so that ``rtp.generate`` works like vLLM's offline API; ``init`` also returns
it for explicit use.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from rtp.config import RtpConfig, checkpoint_dir, default_config_path, load_config, replace_settings
from rtp.errors import RtpError
from rtp.outputs import CompletionOutput, Logprob, RequestOutput
from rtp.sampling import SamplingParams

__all__ = ["init", "generate", "generate_stream", "default_sampling_params", "shutdown", "SamplingParams",
           "RequestOutput", "CompletionOutput", "Logprob", "RtpError"]

_current = None  # the Runtime returned by init(), until shutdown()
_shut_down = False  # a shutdown() ended a runtime in this process: under torchrun its worker ranks have exited


def init(config: RtpConfig | str | os.PathLike | None = None, **overrides):  # noqa: ANN201 - Runtime
    """Start the runtime on this rank; rank 0 gets a Runtime, other ranks never return.

    ``config`` is an RtpConfig, a YAML path, or None for ``configs/cpu.yaml``;
    keyword ``overrides`` replace settings, spelled as in the YAML (``block_size=32``,
    ``cache={"block_size": 32}``; None values are ignored).
    """
    runtime = _init(config, overrides)
    if runtime.dp_rank > 0:  # another replica's coordinator: serve rank 0's batches, then exit like a worker
        from rtp.runtime.replicas import serve_replica

        try:
            serve_replica(runtime)
        finally:
            shutdown()
        sys.exit(0)
    return runtime


def _init(config: RtpConfig | str | os.PathLike | None, overrides: dict):  # noqa: ANN202 - Runtime
    """Start this rank; every replica's coordinator gets its Runtime (the server drives each one itself)."""
    global _current
    from rtp.runtime.onednn_caches import bound_onednn_caches
    from rtp.runtime.startup import start

    bound_onednn_caches()  # before any oneDNN primitive exists: their capacities are read once

    if _current is not None:
        raise RtpError("rtp.init() was already called; call rtp.shutdown() first")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    if _shut_down and world > 1:  # a second world would wait for them forever
        raise RtpError(f"rtp.init() after rtp.shutdown() of a {world}-rank job: its other ranks have "
                       "exited; start a new torchrun job (or keep the first runtime for every batch)")
    if not isinstance(config, RtpConfig):
        config = load_config(config if config is not None else default_config_path(), **overrides)
    elif overrides:
        config = replace_settings(config, **overrides)
    _current = start(config, checkpoint_dir(config))
    return _current


def _runtime():  # noqa: ANN202
    if _current is None:
        raise RtpError("call rtp.init() first")
    return _current


def generate(prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:  # noqa: ANN001
    """Generate for a string, a token-id list, or a list (or tuple) of either; outputs in prompt order. vLLM's
    prompt dicts, ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``, and numpy ids work too.

    ``sampling_params`` None: :func:`default_sampling_params` (the checkpoint's recommended settings)."""
    return _runtime().generate(prompts, sampling_params, use_tqdm)


def generate_stream(prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
    """Stream one request: yields its output after each step that changed it."""
    return _runtime().generate_stream(prompt, sampling_params)


def default_sampling_params(**fields) -> SamplingParams:  # noqa: ANN003
    """SamplingParams of ``fields``, the others from the model's generation_config.json where it recommends
    them (``model.generation_config: auto``, the default), else rtp's defaults (vLLM's
    ``LLM.get_default_sampling_params``)."""
    return _runtime().engine.model_info.default_params(**fields)


def shutdown() -> None:
    """Stop the workers and release everything. Safe to call twice."""
    global _current, _shut_down
    if _current is not None:
        _current.shutdown()
        _current, _shut_down = None, True
