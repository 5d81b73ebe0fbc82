"""Checkpoint loading reports its progress in bytes: every tensor of every file is counted once."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from rtp.distributed.parallel import ParallelState
from rtp.model import loader
from rtp.model.loader import tensor_bytes
from rtp.runtime import model_runner
from rtp.runtime.model_runner import load_model
from rtp.testing import TinyQwen3Spec, make_tiny_qwen3
from tests.utils import SHAPES


def one_rank() -> ParallelState:
    return ParallelState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def file_tensor_bytes(model_dir) -> int:  # noqa: ANN001
    """Bytes of every tensor in the checkpoint, by loading them (independent of the loader's header parsing)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys())
    return total


def load(path, monkeypatch, **overrides) -> tuple[loader.LoadReport, list[int], dict]:  # noqa: ANN001
    """load_model at TP=1, recording the on_progress calls and the arguments it gave load_weights."""
    seen: list[int] = []
    given: dict = {}
    real = loader.load_weights

    def spy(model, model_dir, **kw):  # noqa: ANN001, ANN202
        given.update(kw)
        return real(model, model_dir, **{**kw, **overrides}, on_progress=seen.append)

    monkeypatch.setattr(model_runner, "load_weights", spy)
    _, report = load_model(path, one_rank(), torch.float32)
    return report, seen, given


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_progress_counts_every_byte_of_a_sharded_checkpoint(tmp_path, monkeypatch, dtype):
    path = make_tiny_qwen3(tmp_path / "m", SHAPES["odd_vocab_untied_sharded"], dtype=dtype)
    assert len(list(path.glob("*.safetensors"))) == 2
    report, seen, given = load(path, monkeypatch)
    assert given == {"show_progress": True}  # rank 0 of the run
    want = file_tensor_bytes(path)
    assert sum(seen) == report.checkpoint_bytes == want
    assert len(seen) == report.tensors  # one call per tensor
    assert report.bytes_read == want  # one rank reads everything
    assert report.seconds > 0


def test_a_skipped_tied_head_is_counted_too(tmp_path, monkeypatch):
    """A tied checkpoint that also stores lm_head.weight: the head is not loaded, but its bytes are done."""
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec())
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    report, seen, _ = load(path, monkeypatch)
    assert sum(seen) == file_tensor_bytes(path)
    assert report.bytes_read == sum(seen) - tensors["lm_head.weight"].numel() * 4


def test_header_sizes_match_the_tensors(tmp_path):
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(), dtype=torch.bfloat16)
    sizes = tensor_bytes(path / "model.safetensors")
    tensors = load_file(str(path / "model.safetensors"))
    assert sizes == {n: t.numel() * t.element_size() for n, t in tensors.items()}


def test_the_bar_shows_the_total_on_rank_0_for_large_checkpoints(tmp_path, monkeypatch):
    """With the size threshold lowered and a terminal-like stderr, the bar shows the checkpoint's total bytes."""
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec())

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(loader.sys, "stderr", err)
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    report, _, _ = load(path, monkeypatch)
    total = tqdm.format_sizeof(file_tensor_bytes(path), divisor=1024)  # e.g. "418k"
    assert "Loading weights" in err.getvalue() and f"/{total} " in err.getvalue(), err.getvalue()
    # Not shown on other ranks (show_progress=False) or below the threshold.
    err.truncate(0)
    err.seek(0)
    load(path, monkeypatch, show_progress=False)
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", report.checkpoint_bytes + 1)
    load(path, monkeypatch)
    assert err.getvalue() == ""
