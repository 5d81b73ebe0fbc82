"""Start-up checks of ``speculative_config`` with ``method: draft_model``: one ConfigError line each.

Run on every rank before any model is loaded (:func:`rtp.runtime.startup.start`) and again when rank 0
builds the proposer (an Engine built by hand skips start-up). What fails: a draft tensor-parallel size
other than 1 (the target's TP size is valid but not implemented yet), a draft folder that is not a
Hugging Face checkpoint, a draft of another model type, and a draft whose vocabulary size or tokenizer
differs from the target's (its token ids would mean other tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rtp.config.sections import SpeculativeConfig
from rtp.errors import ConfigError

_KEY = "speculative_config"
_DRAFT_TYPES = ("qwen3", "qwen3_moe")


def _hf_config(folder: Path, what: str) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: cannot read {folder / 'config.json'} ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{what}: {folder / 'config.json'} is not a JSON object")
    return cfg


def _tokenizer_vocab(folder: Path, what: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    try:
        return dict(AutoTokenizer.from_pretrained(str(folder)).get_vocab())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: no tokenizer could be loaded from {folder} ({str(e).splitlines()[0]})") from None


def check_draft_model(spec: SpeculativeConfig, target_dir: Path, tp_size: int) -> None:
    """Raise ConfigError (one line, naming the key) if the draft model of ``spec`` cannot serve the target
    in ``target_dir`` at tensor-parallel size ``tp_size``; nothing for other methods."""
    if spec.method != "draft_model":
        return
    dtp = spec.draft_tensor_parallel_size
    if dtp not in (None, 1):
        if dtp == tp_size:
            raise ConfigError(
                f"{_KEY}.draft_tensor_parallel_size={dtp} (the target's TP size) is not implemented yet: "
                "the draft runs on rank 0 alone; use 1 or null")
        raise ConfigError(f"{_KEY}.draft_tensor_parallel_size={dtp} is invalid: expected 1 or the target's "
                          f"tensor-parallel size {tp_size} (only 1 is implemented yet)")
    assert spec.model is not None, "the config rule requires a model with draft_model"
    draft_dir = Path(spec.model).expanduser()
    what = f"{_KEY}.model={spec.model!r}"
    if not (draft_dir / "config.json").is_file():
        raise ConfigError(f"{what} is not a Hugging Face checkpoint folder (no config.json there); "
                          "give a local folder: rtp never downloads from a model hub")
    draft_cfg, target_cfg = _hf_config(draft_dir, what), _hf_config(target_dir, "the target model")
    if draft_cfg.get("model_type") not in _DRAFT_TYPES:
        raise ConfigError(f"{what} has model_type={draft_cfg.get('model_type')!r}: a draft model must be one of "
                          + ", ".join(_DRAFT_TYPES))
    dv, tv = draft_cfg.get("vocab_size"), target_cfg.get("vocab_size")
    if dv != tv:
        raise ConfigError(f"{what} has vocab_size={dv}, the target {tv}: the draft must share the target's "
                          "vocabulary and tokenizer")
    draft_vocab, target_vocab = _tokenizer_vocab(draft_dir, what), _tokenizer_vocab(target_dir, "the target model")
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))
        token = differ[0][0]
        raise ConfigError(
            f"{what} has another tokenizer than the target ({len(draft_vocab)} vs {len(target_vocab)} tokens; "
            f"e.g. {token!r} is {draft_vocab.get(token)} in the draft, {target_vocab.get(token)} in the target)")
