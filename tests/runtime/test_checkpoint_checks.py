"""A checkpoint folder's checks at load: a readable config.json, and max_model_len within the positions it covers
(its max_position_embeddings, stretched by a static RoPE scaling as vLLM derives it)."""

from __future__ import annotations

import pytest

from rtp.config import CacheConfig, ModelConfig, RtpConfig
from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError
from rtp.runtime.model_runner import ModelRunner
from rtp.testing import TinyQwen3Spec, make_tiny_qwen3


def _runner(model_dir, max_model_len: int | None) -> ModelRunner:
    config = RtpConfig(model=ModelConfig(dtype="float32", enforce_eager=True, max_model_len=max_model_len),
                       cache=CacheConfig(block_size=16, num_kv_blocks=16))
    return ModelRunner(ParallelState.single("cpu"), model_dir, config)


def test_max_model_len_past_the_models_positions_is_refused(tmp_path):
    plain = make_tiny_qwen3(tmp_path / "plain", TinyQwen3Spec(max_position_embeddings=64))
    assert _runner(plain, None).max_model_len == 64
    assert _runner(plain, 64).max_model_len == 64
    with pytest.raises(ConfigError, match=r"max_model_len=65 is longer than the 64 positions .*=64\)"):
        _runner(plain, 65)
    # yarn: its factor times the original positions (here 2 x 48 = 96), as vLLM derives it
    yarn = make_tiny_qwen3(tmp_path / "yarn", TinyQwen3Spec(max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48}))
    assert _runner(yarn, 96).max_model_len == 96
    with pytest.raises(ConfigError, match="the 96 positions .* as its RoPE scaling stretches them"):
        _runner(yarn, 97)


def test_a_malformed_config_json_is_a_config_error_naming_it(tmp_path):
    folder = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(max_position_embeddings=64))
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"m/config.json cannot be read as a Hugging Face config"):
        _runner(folder, None)
    # a field of the wrong kind, on which transformers itself fails with an AttributeError
    (folder / "config.json").write_text(config.replace('"model_type"', '"quantization_config": "fp8", "model_type"'))
    with pytest.raises(ConfigError, match=r"m/config.json cannot be read .*: AttributeError"):
        _runner(folder, None)
