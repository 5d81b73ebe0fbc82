"""What the engine and the server know of the served model, gathered once at start-up.

A :class:`ModelInfo` is built from the checkpoint folder and the loaded model's
shapes before the first request, then handed to whoever needs it (the input
checks, the sampler's EOS handling, the HTTP API), so no one reaches into the
engine or the model runner for the tokenizer or the vocabulary size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


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
    """Token ids that end a completion (see :func:`load_eos_ids`)."""
    max_model_len: int
    """Prompt plus completion tokens a request may have."""

    @classmethod
    def load(cls, model_dir: Path, vocab_size: int, max_model_len: int, name: str | None = None) -> ModelInfo:
        """Load the tokenizer and the EOS ids of the checkpoint in ``model_dir``."""
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(name or Path(model_dir).name, tokenizer, vocab_size, load_eos_ids(Path(model_dir), tokenizer),
                   max_model_len)


def load_eos_ids(model_dir: Path, tokenizer: Any) -> list[int]:  # noqa: ANN401
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
