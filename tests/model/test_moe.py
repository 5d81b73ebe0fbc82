"""Qwen3-MoE in one process: config spellings, sparse/dense layers, split errors, loader errors, the router."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rtp.distributed.parallel import ParallelState
from rtp.errors import CheckpointError, ModelShapeError
from rtp.model.moe import MoERouter, SparseMoeBlock
from rtp.model.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSpec
from rtp.runtime.model_runner import load_model
from rtp.testing import TinyQwen3MoeSpec, make_tiny_qwen3
from tests.model.test_errors import fake_world, rewrite_checkpoint


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    spec = TinyQwen3MoeSpec(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    return make_tiny_qwen3(tmp_path_factory.mktemp("moe"), spec)


def test_sparse_layers_follow_hf_and_both_expert_count_spellings_are_read(tiny_moe, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    spec = Qwen3MoeSpec.from_hf(AutoConfig.from_pretrained(tiny_moe))
    assert spec.sparse_layers == hf_sparse == (1,)  # step 2 gives layers 1 and 3; 3 is dense by the list
    model, _ = load_model(tiny_moe, ParallelState.single(), torch.float32)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Qwen3MLP", "SparseMoeBlock"] + [
        "Qwen3MLP"
    ] * 2
    # Current transformers writes num_local_experts; published checkpoints say num_experts.
    raw = json.loads((tiny_moe / "config.json").read_text())
    raw["num_local_experts"] = raw.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert Qwen3MoeSpec.from_hf(AutoConfig.from_pretrained(tmp_path)).num_experts == 8
    plain = SimpleNamespace(**{k: v for k, v in raw.items() if k != "rope_scaling"})  # no attribute_map here
    assert Qwen3MoeSpec.from_hf(plain).num_experts == 8


@pytest.mark.parametrize(
    "spec, tp, ep, words",
    [
        (TinyQwen3MoeSpec(moe_intermediate_size=30), 4, False, ["moe_intermediate_size=30", "4"]),
        (TinyQwen3MoeSpec(num_experts=6), 4, True, ["num_experts=6", "4"]),
        (TinyQwen3MoeSpec(num_attention_heads=8, hidden_size=128, intermediate_size=100, mlp_only_layers=(0,)), 8,
         False, ["intermediate_size=100", "8"]),
    ],
)
def test_unsplittable_moe_shapes_name_the_numbers(tmp_path, spec, tp, ep, words):
    path = make_tiny_qwen3(tmp_path / "m", spec)
    with pytest.raises(ModelShapeError) as e:
        load_model(path, fake_world(tp), torch.float32, expert_parallel=ep)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_dense_intermediate_size_is_not_checked_without_dense_layers(tmp_path):
    # intermediate_size=100 does not split 8 ways, but no layer is dense (the last case above has one).
    shape = dict(num_attention_heads=8, hidden_size=128, intermediate_size=100)
    spec = Qwen3MoeSpec.from_hf(AutoConfig.from_pretrained(make_tiny_qwen3(tmp_path / "m", TinyQwen3MoeSpec(**shape))))
    assert spec.sparse_layers == (0, 1)
    spec.check_tp(8)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
         r"missing tensor.*model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"),
        (lambda t: t.__setitem__("model.layers.1.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64)),
         r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight'"),
        (lambda t: t.__setitem__("model.layers.1.mlp.experts.2.down_proj.weight", torch.zeros(64, 31)),
         r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight'.*shape \[64, 31\], expected \[64, 32\]"),
        (lambda t: t.pop("model.layers.1.mlp.gate.weight"), r"missing tensor.*model\.layers\.1\.mlp\.gate\.weight"),
        (lambda t: t.__setitem__("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(32, 64)),
         r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight'"),  # layer 0 is dense
    ],
    ids=["missing-expert", "unexpected-expert", "wrong-shape-expert", "missing-router", "expert-in-dense-layer"],
)
def test_broken_moe_checkpoints_name_the_tensor(tiny_moe, tmp_path, edit, pattern):
    path = rewrite_checkpoint(tiny_moe, tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(path, ParallelState.single(), torch.float32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_block_matches_transformers(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block = SparseMoeBlock(32, 16, 8, 3, norm_topk_prob, ParallelState.single())
    block.gate.weight.data.copy_(hf.gate.weight)
    block.experts.w13_weight.data.copy_(hf.experts.gate_up_proj)
    block.experts.w2_weight.data.copy_(hf.experts.down_proj)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        want = hf(x).reshape(18, 32)
        got = block(x.reshape(18, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    weights, _ = MoERouter.forward(block.gate, x.reshape(18, 32))
    sums = weights.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones(18))
    else:
        assert (sums < 1).all()


def test_expert_parallel_ranks_hold_disjoint_whole_experts():
    block = [SparseMoeBlock(64, 32, 8, 2, True, fake_world(4, r), expert_parallel=True) for r in range(4)]
    assert [b.experts.expert_start for b in block] == [0, 2, 4, 6]
    assert all(b.experts.w13_weight.shape == (2, 64, 64) for b in block)  # 2 experts x (gate 32 + up 32)
    tp = SparseMoeBlock(64, 32, 8, 2, True, fake_world(4, 1))
    assert tp.experts.w13_weight.shape == (8, 16, 64) and tp.experts.w2_weight.shape == (8, 64, 8)
    assert Qwen3MoeForCausalLM.param_for(None, "model.layers.3.mlp.experts.12.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (12, 1))
