"""The KV cache's zero-filled allocation (:func:`rtp.runtime.kv_cache.zeroed`) and its memory check."""

import gc

import pytest
import torch

from rtp.distributed.parallel import ParallelState
from rtp.errors import ConfigError
from rtp.runtime import kv_cache
from rtp.runtime.kv_cache import available_memory, plan_num_blocks, zeroed

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeroed_matches_torch_zeros_and_is_independent_memory(dtype):
    shape = (5, 16, 2, 8)
    a, b = zeroed(shape, dtype, CPU), zeroed(shape, dtype, CPU)
    gc.collect()  # nothing but the tensors holds the mappings
    for t in (a, b):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device == CPU
        assert torch.equal(t.float(), torch.zeros(shape))
    a[2, 3] = 1.5  # writable, and b is not a view of the same memory
    gc.collect()
    assert a.float().sum().item() == pytest.approx(1.5 * 2 * 8)
    assert b.float().abs().sum().item() == 0.0


def test_zeroed_views_outlive_the_tensor_they_came_from():
    t = zeroed((4, 1024), torch.float32, CPU)
    view = t[1:3]
    del t
    gc.collect()
    view += 2.0  # the mapping is still there: writing to it must not fault
    assert torch.equal(view, torch.full((2, 1024), 2.0))


def test_zeroed_falls_back_to_torch_zeros_off_the_cpu_and_for_empty_shapes():
    t = zeroed((3, 4), torch.float32, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (3, 4)
    e = zeroed((0, 16, 2, 8), torch.bfloat16, CPU)
    assert e.shape == (0, 16, 2, 8) and e.dtype == torch.bfloat16


def test_a_cache_larger_than_the_memory_available_is_reported(monkeypatch, caplog):
    ps = ParallelState.single("cpu")
    kw = dict(fixed=None, cpu_cache_gib=1.0, gpu_memory_utilization=0.9)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 2**31)
    with caplog.at_level("WARNING", logger=kv_cache.logger.name):
        assert plan_num_blocks(ps, 2**20, **kw) == 1024  # 1 GiB of 1 MiB blocks, within 2 GiB
        assert "available" not in caplog.text
        monkeypatch.setattr(kv_cache, "available_memory", lambda: 2**29)
        assert plan_num_blocks(ps, 2**20, **kw) == 1024  # still the budget asked for, with a warning
    assert "1.0 GiB and 0.5 GiB of memory is available" in caplog.text


def test_available_memory_reads_the_kernels_figure():
    got = available_memory()
    assert got is None or 0 < got <= 2**50


def test_a_budget_without_room_for_one_block_is_a_config_error_naming_it():
    ps = ParallelState.single("cpu")
    with pytest.raises(ConfigError, match=r"cpu_kv_cache_gib=1e-06 leaves no room .* a block takes 2097152 bytes"):
        plan_num_blocks(ps, 2**21, fixed=None, cpu_cache_gib=1e-6, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="num_kv_blocks=0 leaves no room"):
        plan_num_blocks(ps, 2**21, fixed=0, cpu_cache_gib=1.0, gpu_memory_utilization=0.9)
