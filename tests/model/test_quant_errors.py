"""Broken or unsupported quantized checkpoints fail with one line naming the tensor or the config key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtp.distributed.parallel import ParallelState
from rtp.errors import CheckpointError
from rtp.runtime.model_runner import load_model
from rtp.testing import TinyQwen3Spec, make_tiny_qwen3
from rtp.testing_quant import write_awq_checkpoint, write_fp8_checkpoint

SPEC = TinyQwen3Spec(hidden_size=128, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=64, num_hidden_layers=1)
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8_checkpoint(make_tiny_qwen3(root / "src", SPEC), root / "fp8")


def edited(src: Path, dst: Path, tensors=None, config=None) -> Path:  # noqa: ANN001
    """A copy of ``src`` whose tensors went through ``tensors(dict)`` and config through ``config(dict)``."""
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(str(src / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    if config is not None:
        c = json.loads((src / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def load_error(path: Path) -> str:
    ps = ParallelState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(CheckpointError) as e:
        load_model(path, ps, torch.float32)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_fp8_checkpoint_loads(fp8):
    """The unedited checkpoint loads, and its down projection is the dequantized one."""
    ps = ParallelState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model, _ = load_model(fp8, ps, torch.float32)
    t = load_file(str(fp8 / "model.safetensors"))
    w, s = t[DOWN + ".weight"].double(), t[DOWN + ".weight_scale_inv"].double()  # [128, 384], [1, 3]
    want = w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    down = model.model.layers[0].mlp.down_proj
    got = down.weight if down.packed is None else down.matmul(torch.eye(384)).t()  # packed: recover W by x = I
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7)


def test_truncated_scale_is_named(fp8, tmp_path):
    path = edited(fp8, tmp_path / "m", tensors=lambda t: t.update(
        {DOWN + ".weight_scale_inv": t[DOWN + ".weight_scale_inv"][:, :2].contiguous()}))
    msg = load_error(path)
    assert f"'{DOWN}.weight_scale_inv'" in msg and "[1, 2]" in msg and "[1, 3]" in msg, msg


def test_missing_scale_is_named(fp8, tmp_path):
    path = edited(fp8, tmp_path / "m", tensors=lambda t: t.pop(DOWN + ".weight_scale_inv"))
    msg = load_error(path)
    assert "missing" in msg and f"{DOWN}.weight_scale_inv" in msg, msg


def test_block_size_other_than_128_is_named(fp8, tmp_path):
    path = edited(fp8, tmp_path / "m",
                  config=lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))
    msg = load_error(path)
    assert "weight_block_size=[64, 64]" in msg and "[128, 128]" in msg, msg


def test_weight_not_in_fp8_is_named(fp8, tmp_path):
    path = edited(fp8, tmp_path / "m", tensors=lambda t: t.update(
        {DOWN + ".weight": t[DOWN + ".weight"].to(torch.bfloat16)}))
    msg = load_error(path)
    assert f"'{DOWN}.weight'" in msg and "BF16" in msg and "F8_E4M3" in msg, msg


@pytest.mark.parametrize("edit, words", [
    (lambda q: q.update(quant_method="gptq"), ["quant_method='gptq'", "'fp8'", "'awq'"]),
    (lambda q: q.update(activation_scheme="static"), ["activation_scheme='static'"]),
    (lambda q: q.update(quant_method="awq", bits=8), ["bits=8"]),
    # one module name as a string, not split into its letters
    (lambda q: q.update(modules_to_not_convert="model.layers.0.mlp.down_proj"), ["['model.layers.0.mlp.down_proj']"]),
])
def test_unsupported_quantization_config_is_named(fp8, tmp_path, edit, words):
    path = edited(fp8, tmp_path / "m", config=lambda c: edit(c["quantization_config"]))
    msg = load_error(path)
    assert "quantization_config" in msg and all(w in msg for w in words), msg


def test_awq_tensor_of_wrong_shape_is_named(tmp_path):
    path = write_awq_checkpoint(make_tiny_qwen3(tmp_path / "src", SPEC), tmp_path / "awq", tmp_path / "ref")
    bad = edited(path, tmp_path / "m", tensors=lambda t: t.update(
        {DOWN + ".qzeros": t[DOWN + ".qzeros"][:2].contiguous()}))
    msg = load_error(bad)
    assert f"'{DOWN}.qzeros'" in msg and "[2, 16]" in msg and "[3, 16]" in msg, msg
