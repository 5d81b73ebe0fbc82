"""What the engine and the server know of the served model, gathered once at start-up.

A :class:`ModelInfo` is built from the checkpoint folder and the loaded model's
shapes before the first request, then handed to whoever needs it (the input
checks, the sampler's EOS handling, the HTTP API), so no one reaches into the
engine or the model runner for the tokenizer or the vocabulary size.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rtp.errors import ConfigError, RequestError
from rtp.sampling import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json keys that become request defaults (vLLM's ``--generation-config auto`` reads these),
with the SamplingParams field each sets (HF's max_new_tokens is max_tokens)."""


@dataclass(frozen=True)
class ModelInfo:
    """The served model as its users see it."""

    name: str
    """The model's name in the API (``server.served_model_name``, else the checkpoint folder's name)."""
    tokenizer: Any
    """The Hugging Face tokenizer of the checkpoint (a fast tokenizer: share it between two threads at most)."""
    vocab_size: int
    """Rows of the model's LM head: every token id is below this."""
    eos_token_ids: list[int]
    """Token ids that end a completion (see :func:`eos_ids`)."""
    max_model_len: int
    """Prompt plus completion tokens a request may have."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's recommended sampling settings (see :func:`sampling_defaults_of`): the values of the
    SamplingParams fields a request leaves unset."""

    @classmethod
    def load(cls, model_dir: Path, vocab_size: int, max_model_len: int, name: str | None = None,
             generation_config: str = "none") -> ModelInfo:
        """Load the tokenizer, the EOS ids and (``generation_config="auto"``) the sampling defaults of the
        checkpoint in ``model_dir``."""
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not tokenizer.encode("a b", add_special_tokens=False):
            # (transformers builds an empty tokenizer from config.json's model_type where the files are missing)
            found = sorted(p.name for p in Path(model_dir).glob("*") if p.name.startswith(("tokenizer", "vocab")))
            raise ConfigError(f"{model_dir} has no usable tokenizer ({', '.join(found) or 'no tokenizer files'}): "
                              "the checkpoint's tokenizer.json (or vocab.json + merges.txt) and tokenizer_config.json "
                              "belong in the same folder")
        path = Path(model_dir) / GENERATION_CONFIG
        gen = json.loads(path.read_text()) if path.exists() else {}  # read once for the EOS ids and the defaults
        defaults = sampling_defaults_of(gen, path) if generation_config == "auto" else {}
        return cls(name or Path(model_dir).name, tokenizer, vocab_size, eos_ids(gen, tokenizer), max_model_len,
                   defaults)

    def stop_reason_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that a request with ``params`` names as its stop_reason when they end it, as vLLM's: its
        stop_token_ids and, unless ignore_eos, the generation config's EOS ids, less the tokenizer's EOS id
        unless ignore_eos (vLLM checks that one first, as the EOS: stop_reason None, even where stop_token_ids
        name it)."""
        ids = frozenset(params.stop_token_ids or ())
        if params.ignore_eos:
            return ids
        return (ids | set(self.eos_token_ids)) - {self.tokenizer.eos_token_id}

    def default_params(self, **fields: Any) -> SamplingParams:  # noqa: ANN401
        """SamplingParams of ``fields``, the checkpoint's sampling defaults filling the fields not given."""
        return SamplingParams(**{**self.sampling_defaults, **fields})


def sampling_defaults_of(gen: dict[str, Any], path: Path) -> dict[str, Any]:
    """The sampling settings the checkpoint's generation_config.json (``gen``, parsed from ``path``) recommends
    (Qwen3 ships temperature 0.6, top_p 0.95, top_k 20), as SamplingParams fields. As vLLM does by default,
    they replace rtp's defaults (temperature 1.0, no top-p/top-k; a server's default_max_tokens) for every
    field a request does not set.
    ConfigError if a value is not a valid setting."""
    defaults = {name: gen[key] for key, name in SAMPLING_DEFAULT_KEYS.items() if gen.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (RequestError, TypeError) as e:
        raise ConfigError(f"{path}: {e} (model.generation_config: none ignores the file's sampling settings)"
                          ) from None
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own values win; model.generation_config: none "
                    "keeps rtp's)", path.name, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def eos_ids(gen: dict[str, Any], tokenizer: Any) -> list[int]:  # noqa: ANN401
    """EOS ids from generation_config.json (``gen``, parsed; the id may be a list) and the tokenizer."""
    ids: set[int] = set()
    eos = gen.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
