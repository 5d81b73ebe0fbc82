"""Pipeline stages' layer ranges and the pipeline settings' validation (no processes started)."""

from __future__ import annotations

import pytest

from rtp.config import RtpConfig, load_config, resolve_tp_size
from rtp.distributed.pipeline import stage_layers
from rtp.errors import ConfigError


@pytest.mark.parametrize(("layers", "pp", "sizes"), [
    (4, 2, [2, 2]),
    (3, 2, [1, 2]),  # the remainder goes to the last stage before the first (embedding, LM head, rank 0)
    (5, 4, [1, 1, 2, 1]),  # middle stages first
    (7, 4, [1, 2, 2, 2]),
    (94, 2, [47, 47]),
    (10, 1, [10]),
])
def test_even_split_keeps_the_remainder_away_from_the_first_stage(layers, pp, sizes):
    ranges = stage_layers(layers, pp)
    assert [len(r) for r in ranges] == sizes
    assert ranges[0].start == 0 and ranges[-1].stop == layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap or overlap


def test_partition_overrides_and_is_checked():
    assert stage_layers(4, 2, (3, 1)) == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError, match="summing to the model's 4 layers"):
        stage_layers(4, 2, (2, 1))
    with pytest.raises(ConfigError, match="larger than the model's 2 layers"):
        stage_layers(2, 3)


def test_pipeline_settings_are_validated(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline_parallel_size: 2\npipeline_layer_partition: [3, 1]\ntensor_parallel_size: 2\n")
    config = load_config(cfg)
    assert config.parallel.pipeline_layer_partition == (3, 1)
    assert resolve_tp_size(config, 4) == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 x pipeline_parallel_size 2 does not match"):
        resolve_tp_size(config, 2)
    assert resolve_tp_size(load_config(None, pipeline_parallel_size=2), 6) == 3
    with pytest.raises(ConfigError, match="pipeline_parallel_size=4 does not divide the 6 ranks"):
        resolve_tp_size(load_config(None, pipeline_parallel_size=4), 6)
    with pytest.raises(ConfigError, match="pipeline_layer_partition.*one entry per stage"):
        load_config(None, pipeline_parallel_size=3, pipeline_layer_partition=[1, 2])
    with pytest.raises(ConfigError, match="pipeline_parallel_size=0 is invalid"):
        load_config(None, pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match="pipeline_layer_partition.*non-empty list of integers >= 1"):
        load_config(None, pipeline_parallel_size=2, pipeline_layer_partition="2,x")
    assert load_config(None, pipeline_layer_partition="2,2", pipeline_parallel_size=2).parallel \
        .pipeline_layer_partition == (2, 2)
    assert RtpConfig().parallel.pipeline_parallel_size == 1


@pytest.mark.parametrize("name", ["2x8xH100-pp", "2x8xH200-qwen3-235b-a22b-pp"])
def test_shipped_pipeline_files_are_tp8_x_pp2_on_16_gpus(name):
    from pathlib import Path

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml")
    assert config.parallel.pipeline_parallel_size == 2 and config.parallel.device == "cuda"
    assert resolve_tp_size(config, 16) == 8
    assert [len(r) for r in stage_layers(94, 2, config.parallel.pipeline_layer_partition)] == [47, 47]
