"""Load a safetensors checkpoint, giving each rank only its slice.

Tensors are opened with ``safe_open(...).get_slice(name)`` and each
parameter's ``weight_loader`` reads just the rows/columns its rank owns, so a
rank never materialises a whole sharded tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rtp.errors import CheckpointError
from rtp.log import get_logger
from rtp.model.linear import load_full
from rtp.model.qwen3 import Qwen3ForCausalLM

logger = get_logger(__name__)


@dataclass
class LoadReport:
    """What a rank read from the checkpoint."""

    tensors: int = 0
    bytes_read: int = 0  # bytes of the slices this rank copied out of the files


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (sharded with an index, or one file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"checkpoint index names {f.name}, which is missing from {model_dir}")
    return files


def load_weights(model: Qwen3ForCausalLM, model_dir: str | Path) -> LoadReport:
    """Copy this rank's slice of every checkpoint tensor into ``model``.

    A missing tensor, an unexpected one, or one of the wrong full shape raises
    :class:`CheckpointError` naming it.
    """
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    expected = model.checkpoint_shapes()
    seen: set[str] = set()
    report = LoadReport()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                    continue  # tied: the embedding is the head; some checkpoints store both
                if name not in expected:
                    raise CheckpointError(f"unexpected tensor {name!r} in {path.name}: not part of a Qwen3 model")
                source = f.get_slice(name)
                if list(source.get_shape()) != expected[name]:
                    raise CheckpointError(
                        f"tensor {name!r} in {path.name} has shape {list(source.get_shape())}, "
                        f"expected {expected[name]}"
                    )
                param_name, shard = model.param_for(name)
                param = params[param_name]
                loader = getattr(param, "weight_loader", load_full)
                counted = _CountingSource(source)
                try:
                    loader(param, counted, shard)
                except CheckpointError as e:
                    raise CheckpointError(f"tensor {name!r}: {e}") from None
                report.tensors += 1
                report.bytes_read += counted.bytes_read
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor(s) {missing[:5]}{more}")
    mib = report.bytes_read / 2**20
    logger.info("loaded %d tensors (%.1f MiB on this rank) from %s", report.tensors, mib, model_dir)
    return report


class _CountingSource:
    """Wraps a sliceable source and counts the bytes of every slice taken."""

    def __init__(self, source) -> None:  # noqa: ANN001
        self.source = source
        self.bytes_read = 0

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, idx) -> torch.Tensor:  # noqa: ANN001
        t = self.source[idx]
        self.bytes_read += t.numel() * t.element_size()
        return t
