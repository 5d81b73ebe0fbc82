"""Load a safetensors checkpoint, giving each rank only its slice.

Tensors are opened with ``safe_open(...).get_slice(name)`` and each
parameter's ``weight_loader`` reads just the rows/columns its rank owns, so a
rank never materialises a whole sharded tensor.

Rank 0 shows a progress bar (checkpoint bytes per second, on stderr, only on a terminal and for
checkpoints of at least ``PROGRESS_MIN_BYTES``); every rank logs a one-line summary (GB, s, GB/s).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from tqdm import tqdm

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
    checkpoint_bytes: int = 0  # bytes of every tensor in the files (what the progress bar counts)
    seconds: float = 0.0
    kv_scales: int = 0  # optional tensors found: the FP8 KV cache's per-layer k_scale / v_scale


# A smaller checkpoint loads too fast for a progress bar to be worth its lines.
PROGRESS_MIN_BYTES = 64 * 2**20


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (sharded with an index, or one file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_dir / f for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise CheckpointError(f"{index}: not a readable checkpoint index ({why})") from None
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"checkpoint index names {f.name}, which is missing from {model_dir}")
    return files


def checkpoint_fingerprint(model_dir: Path) -> dict[str, str]:
    """File name -> a digest of config.json and of each safetensors file (its size, its first and last MiB:
    the header and tensors at both ends), to tell two nodes' copies of a checkpoint apart without reading it."""
    out = {"config.json": xxhash.xxh64((model_dir / "config.json").read_bytes()).hexdigest()}
    for path in checkpoint_files(model_dir):
        h, size = xxhash.xxh64(), path.stat().st_size
        with open(path, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(size - 2**20, 0))
            h.update(f.read())
        out[path.name] = f"{size}:{h.hexdigest()}"
    return out


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header alone (no tensor is read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        entries = {name: e for name, e in header.items() if name != "__metadata__"}
        sizes = {name: int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for name, e in entries.items()}
        end = 8 + n + max((int(e["data_offsets"][1]) for e in entries.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    size = path.stat().st_size
    if size < end:  # the header reads, the tensors do not: a copy cut short
        raise CheckpointError(f"{path}: truncated ({size} bytes, its header describes {end})")
    return sizes


def load_weights(model: Qwen3ForCausalLM, model_dir: str | Path, *, show_progress: bool = False,
                 on_progress: Callable[[int], None] | None = None) -> LoadReport:
    """Copy this rank's slice of every checkpoint tensor into ``model``.

    A missing tensor, an unexpected one, or one of the wrong full shape raises
    :class:`CheckpointError` naming it. The model's optional tensors (the FP8 KV cache's scales) are
    loaded where the checkpoint has them and keep their defaults otherwise. ``show_progress`` (rank 0) draws a bar of
    the checkpoint's bytes on stderr; ``on_progress(n)`` is called with each
    tensor's bytes as it is done (skipped ones included), summing to the checkpoint's size.
    """
    model_dir = Path(model_dir)
    # Parameters, and the buffers a checkpoint may set (the KV scales).
    params: dict[str, torch.Tensor] = dict(model.named_parameters()) | dict(model.named_buffers())
    required = model.checkpoint_shapes()
    optional = model.optional_checkpoint_shapes()
    expected = required | optional
    seen: dict[str, str] = {}  # tensor name -> the file it was loaded from
    report = LoadReport()
    files = checkpoint_files(model_dir)
    sizes = {path: tensor_bytes(path) for path in files}
    total = sum(sum(s.values()) for s in sizes.values())
    # disable=None: tqdm itself turns the bar off when stderr is not a terminal.
    bar = tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=True if not show_progress or total < PROGRESS_MIN_BYTES else None, leave=False)
    start = time.perf_counter()
    with bar:
        for path in files:
            _load_file(model, path, sizes[path], params, expected, seen, report, bar, on_progress)
    report.seconds = time.perf_counter() - start
    kv_scales = seen.keys() & optional.keys()
    report.kv_scales = len(kv_scales)
    for name in sorted(kv_scales):  # a layer's KV scales come as a pair
        pair = name[:-7] + ("v_scale" if name.endswith("k_scale") else "k_scale")
        if pair not in seen:
            raise CheckpointError(f"checkpoint {model_dir} holds {name} but not {pair}: give both KV scales or none")
    missing = sorted(required.keys() - seen.keys())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor(s) {missing[:5]}{more}")
    model.process_weights_after_loading()  # a quantized checkpoint's projections dequantized, once
    gb = report.checkpoint_bytes / 1e9
    logger.info("loaded %d tensors from %s: %.2f GB in %.1f s (%.2f GB/s), %.1f MiB on this rank", report.tensors,
                model_dir, gb, report.seconds, gb / max(report.seconds, 1e-9), report.bytes_read / 2**20)
    return report


def _load_file(model: Qwen3ForCausalLM, path: Path, sizes: dict[str, int], params: dict[str, torch.Tensor],
               expected: dict[str, list[int]], seen: dict[str, str], report: LoadReport, bar: tqdm,
               on_progress: Callable[[int], None] | None) -> None:
    """Load this rank's slices of one file's tensors (see :func:`load_weights`)."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors' own SafetensorError, OSError ...
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    with handle as f:
        for name in f.keys():
            done = sizes.get(name, 0)
            report.checkpoint_bytes += done
            tied_copy = name == "lm_head.weight" and model.spec.tie_word_embeddings
            # tied: the embedding is the head (some checkpoints store both); another pipeline stage's
            # tensor is that stage's to load
            if not tied_copy and model.owns_tensor(name):
                _load_tensor(model, f, path, name, params, expected, seen, report)
            bar.update(done)
            if on_progress is not None:
                on_progress(done)


def _load_tensor(model: Qwen3ForCausalLM, f: Any, path: Path, name: str, params: dict[str, torch.Tensor],
                 expected: dict[str, list[int]], seen: dict[str, str], report: LoadReport) -> None:
    """Check one tensor's name and full shape, then copy this rank's slice of it into its parameter."""
    if name not in expected:
        raise CheckpointError(f"unexpected tensor {name!r} in {path.name}: not part of a Qwen3 model")
    if name in seen:  # loading it twice would overwrite it, or multiply an FP8 scale in twice
        raise CheckpointError(f"tensor {name!r} is stored twice: in {seen[name]} and in {path.name}")
    source = f.get_slice(name)
    if not _shape_fits(list(source.get_shape()), expected[name]):
        raise CheckpointError(
            f"tensor {name!r} in {path.name} has shape {list(source.get_shape())}, "
            f"expected {expected[name]}"
        )
    param_name, shard = model.param_for(name)
    param = params[param_name]
    loader: Callable[..., None] = getattr(param, "weight_loader", load_full)
    counted = _CountingSource(source)
    try:
        loader(param, counted, shard)
    except CheckpointError as e:
        raise CheckpointError(f"tensor {name!r}: {e}") from None
    report.tensors += 1
    report.bytes_read += counted.bytes_read
    seen[name] = path.name


def _shape_fits(shape: list[int], expected: list[int]) -> bool:
    """The checkpoint's shape is the expected one; a scalar may also be stored as ``[1]`` (FP8 checkpoints do both)."""
    return shape == expected or (expected == [] and shape == [1])


class _CountingSource:
    """Wraps a sliceable source and counts the bytes of every slice taken."""

    def __init__(self, source) -> None:  # noqa: ANN001
        self.source = source
        self.bytes_read = 0

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def get_dtype(self) -> str:
        return self.source.get_dtype()

    def __getitem__(self, idx) -> torch.Tensor:  # noqa: ANN001
        t = self.source[idx]
        self.bytes_read += t.numel() * t.element_size()
        return t
