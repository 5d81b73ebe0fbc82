"""Clear errors for shapes that cannot be split and for broken checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtp.distributed.parallel import ParallelState
from rtp.errors import CheckpointError, ModelShapeError
from rtp.runtime.model_runner import load_model
from rtp.testing import TinyQwen3Spec, make_tiny_qwen3


def fake_world(tp: int, rank: int = 0) -> ParallelState:
    # Shape checks run before any collective, so no process group is needed.
    return ParallelState(rank=rank, world_size=tp, local_rank=rank, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny"), TinyQwen3Spec(tie_word_embeddings=False))


@pytest.mark.parametrize(
    "spec, tp, words",
    [
        (TinyQwen3Spec(), 3, ["num_attention_heads=4", "3"]),
        (TinyQwen3Spec(num_attention_heads=6, num_key_value_heads=6, hidden_size=96), 4,
         ["num_attention_heads=6", "4"]),
        (TinyQwen3Spec(num_attention_heads=8, num_key_value_heads=4, hidden_size=128, intermediate_size=100), 8,
         ["intermediate_size=100", "8"]),
        (TinyQwen3Spec(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96), 2,
         ["num_key_value_heads=3", "2"]),
    ],
)
def test_unsplittable_shapes_name_the_numbers(tmp_path, spec, tp, words):
    path = make_tiny_qwen3(tmp_path / "m", spec)
    with pytest.raises(ModelShapeError) as e:
        load_model(path, fake_world(tp), torch.float32)
    for w in words:
        assert w in str(e.value), str(e.value)


def rewrite_checkpoint(src, dst, edit):  # noqa: ANN001, ANN201
    """A copy of checkpoint folder ``src`` in ``dst`` whose tensors went through ``edit(dict)``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tiny, tmp_path):
    path = rewrite_checkpoint(tiny, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path, ParallelState.single(), torch.float32)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    path = rewrite_checkpoint(tiny, tmp_path / "m",
                              lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_model(path, ParallelState.single(), torch.float32)


def test_wrong_shape_is_named(tiny, tmp_path):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()

    path = rewrite_checkpoint(tiny, tmp_path / "m", shrink)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape"):
        load_model(path, ParallelState.single(), torch.float32)


def test_a_tensor_stored_twice_is_named(tiny, tmp_path):
    # an FP8 weight or scale loaded twice is multiplied in twice; a float one overwritten: either way, refused
    path = rewrite_checkpoint(tiny, tmp_path / "m", lambda t: None)
    save_file({"model.layers.1.mlp.up_proj.weight": load_file(str(tiny / "model.safetensors"))[
        "model.layers.1.mlp.up_proj.weight"]}, str(path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is stored twice"):
        load_model(path, ParallelState.single(), torch.float32)


def test_one_ranks_share_loads_without_process_groups(tiny):
    # scripts/check_checkpoint.py: rank 1 of 2 checks its slice alone, with no other rank to agree with
    _, report = load_model(tiny, fake_world(2, rank=1), torch.float32)
    assert report.tensors > 0 and 0 < report.bytes_read < report.checkpoint_bytes


def test_missing_shard_file_is_reported(tmp_path):
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(num_shards=2))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_model(path, ParallelState.single(), torch.float32)


def test_other_architectures_are_refused(tiny, tmp_path):
    path = rewrite_checkpoint(tiny, tmp_path / "m", lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelShapeError, match="qwen3"):
        load_model(path, ParallelState.single(), torch.float32)


@pytest.mark.parametrize("names, refused", [(["Qwen3ForSequenceClassification"], True),
                                            (["Qwen3ForCausalLM"], False), (None, False)])
def test_an_architecture_other_than_the_causal_lm_is_refused(tiny, tmp_path, names, refused):
    path = rewrite_checkpoint(tiny, tmp_path / "m", lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures", None)
    if names is not None:
        cfg["architectures"] = names
    (path / "config.json").write_text(json.dumps(cfg))
    if refused:
        with pytest.raises(ModelShapeError, match="Qwen3ForSequenceClassification.*causal LM"):
            load_model(path, ParallelState.single(), torch.float32)
    else:
        load_model(path, ParallelState.single(), torch.float32)


@pytest.mark.parametrize("name, dtype", [("model.layers.0.input_layernorm.weight", torch.int32),
                                         ("model.embed_tokens.weight", torch.float8_e4m3fn),
                                         ("model.layers.1.mlp.down_proj.weight", torch.int8),
                                         ("lm_head.weight", torch.uint8)])
def test_a_float_tensor_stored_as_integers_or_fp8_is_named(tiny, tmp_path, name, dtype):
    # A float checkpoint (or a quantized one's unquantized tensors): cast silently, it gave garbage tokens.
    path = rewrite_checkpoint(tiny, tmp_path / "m", lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(CheckpointError) as e:
        load_model(path, ParallelState.single(), torch.float32)
    assert f"'{name}'" in str(e.value) and str(dtype) in str(e.value), str(e.value)


def test_a_broken_index_or_a_truncated_file_is_one_line(tmp_path):
    path = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(num_shards=2))
    index = path / "model.safetensors.index.json"
    good = index.read_text()
    for text, words in (("{not json", "not a readable checkpoint index"), ('{"metadata": {}}', "no 'weight_map'")):
        index.write_text(text)
        with pytest.raises(CheckpointError, match=words):
            load_model(path, ParallelState.single(), torch.float32)
    index.write_text(good)
    victim = path / sorted(set(json.loads(good)["weight_map"].values()))[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # the header reads, the tensors do not
    with pytest.raises(CheckpointError, match=rf"{victim.name}: truncated"):
        load_model(path, ParallelState.single(), torch.float32)


@pytest.mark.parametrize("scales, words", [({"k_scale": 0.5}, "not model.layers.0.self_attn.v_scale"),
                                           ({"k_scale": 0.0, "v_scale": 1.0}, "positive finite number, got [0.0]"),
                                           ({"k_scale": -1.0, "v_scale": 1.0}, "positive finite"),
                                           ({"k_scale": float("nan"), "v_scale": 1.0}, "positive finite")])
def test_kv_scales_come_in_positive_pairs(tiny, tmp_path, scales, words):
    def add(t):
        t.update({f"model.layers.0.self_attn.{k}": torch.tensor(v) for k, v in scales.items()})

    path = rewrite_checkpoint(tiny, tmp_path / "m", add)
    with pytest.raises(CheckpointError) as e:
        load_model(path, ParallelState.single(), torch.float32)
    assert words in str(e.value), str(e.value)
