"""EAGLE-3 speculative decoding in one process: heads load in SpecForge's and the speculators format,
bad heads fail at start with one line, greedy outputs equal rtp's own without speculation (and HF's)
token for token with chunked prefill, preemption and prefix caching, and every draft equals what an
independent float64 reference of the head computes from HF transformers' hidden states (which checks
the auxiliary layers, positions and the head's KV bookkeeping that output equality cannot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rtp.assets import trained_eagle3_dir, trained_model_dir
from rtp.config import SpeculativeConfig
from rtp.core.sequence import Sequence
from rtp.errors import ConfigError
from rtp.runtime.model_runner import StepOutput
from rtp.runtime.stage_output import AuxHidden
from rtp.sampling import SamplingParams
from rtp.spec.eagle3 import Eagle3Proposer, open_head
from rtp.testing import default_model_dir
from tests.spec.drafts import write_eagle3_head
from tests.spec.test_spec_engine import make_engine, run
from tests.utils import hf_greedy

K = 3
MAX_TOKENS = 32
LENGTHS = (3, 17, 40, 70, 25)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def eagle_config(head: Path, k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=k,
                             disable_by_batch_size=None, min_acceptance_rate=0.0)


@pytest.fixture(scope="module")
def target() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    return {fmt: write_eagle3_head(root / fmt, target, fmt=fmt, scale=3.0) for fmt in ("specforge", "speculators")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def reference_drafts(hf, head: Path, tokens: list[int], room: int) -> list[int]:
    """The head's greedy drafts after ``tokens``, recomputed densely in float64 from the checkpoint tensors
    and HF's hidden states (``hidden_states[i]``: the input of layer i), without any cache."""
    cfg = json.loads((head / "config.json").read_text())
    speculators = "speculators_model_type" in cfg
    layer = cfg["transformer_layer_config"] if speculators else cfg
    t = {k: v.double() for k, v in load_file(head / "model.safetensors").items()}
    p = "layers.0." if speculators else "midlayer."
    aux = cfg["eagle_aux_hidden_state_layer_ids"] if speculators else cfg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else hf.model.embed_tokens.weight.double()
    nh, nkv, d = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return t[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + layer["rms_norm_eps"])

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [n, heads, d] at positions 0..n-1
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv  # [n, d/2]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    a = torch.cat([states[i][0].double() for i in aux], dim=-1)  # [L-1, 3H]
    feats = F.linear(a, t["fc.weight"], t.get("fc.bias"))
    ids = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(room):
        e = embed[torch.tensor(ids)]
        if cfg.get("norm_before_residual"):
            g = norm(feats, p + "hidden_norm.weight")
            res = g
        else:
            res, g = feats, norm(feats, p + "hidden_norm.weight")
        x = torch.cat([norm(e, p + "input_layernorm.weight"), g], dim=-1)
        n = x.shape[0]
        q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n, nh, d))
        k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n, nkv, d)).repeat_interleave(nh // nkv, 1)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, nkv, d).repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, nh * d)
        r = res + o @ t[p + "self_attn.o_proj.weight"].T
        m = norm(r, p + "post_attention_layernorm.weight")
        out = r + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
            p + "mlp.down_proj.weight"].T
        logits = norm(out[-1], "norm.weight") @ t["lm_head.weight"].T
        d_id = int(logits.argmax())
        tok = d_id + int(t["d2t"][d_id])
        drafts.append(tok)
        ids.append(tok)
        feats = torch.cat([feats, out[-1:]])
    return drafts


def recording(engine) -> list[tuple[list[int], int, list[int]]]:  # noqa: ANN001
    """Wrap the engine's proposer: every (tokens, room, drafts) it proposes is appended to the returned list."""
    proposer = engine.spec.proposer
    seen: list[tuple[list[int], int, list[int]]] = []
    inner = proposer.propose

    def propose(seqs, rooms):  # noqa: ANN001, ANN202
        drafts = inner(seqs, rooms)
        seen.extend((list(s.token_ids), r, d) for s, r, d in zip(seqs, rooms, drafts))
        return drafts

    proposer.propose = propose
    return seen


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_greedy_with_eagle3_equals_plain_and_the_drafts_the_reference(target, heads, prompts, fmt) -> None:
    """20 tokens per step (prompts chunked next to drafts), 12 blocks of 16 (preemption), no prefix caching
    (test_with_prefix_hits_every_draft_is_the_reference covers hits)."""
    plain = run(make_engine(target, budget=20, blocks=12, caching=False), [(p, GREEDY) for p in prompts], late=1)
    engine = make_engine(target, eagle_config(heads[fmt]), budget=20, blocks=12, caching=False)
    seen = recording(engine)
    outs = run(engine, [(p, GREEDY) for p in prompts], late=1)
    stats = engine.stats()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 200
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert len(seen) > 80
    for tokens, room, drafts in seen[::4]:
        assert drafts == reference_drafts(hf, heads[fmt], tokens, room), (len(tokens), room)


def test_greedy_with_prefix_hits_equals_hf(target, heads, prompts) -> None:
    engine = make_engine(target, eagle_config(heads["specforge"]), budget=20, blocks=12)
    shared = [prompts[3][:40] + p[:5] for p in prompts]
    outs = run(engine, [(p, GREEDY) for p in shared], late=2)
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["num_preemptions"] > 0 and stats["spec_num_drafts"] > 50
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in shared]
    proposer = engine.spec.proposer if engine.spec is not None else None
    assert isinstance(proposer, Eagle3Proposer)
    proposer.sync([])  # nothing runs any more: every sequence's state is dropped
    assert all(proposer.num_computed(i) == 0 for i in range(50)) and not proposer._feats


def test_a_batch_above_the_cut_off_keeps_no_features_and_outputs_equal_plain(target, heads, prompts) -> None:
    """Five sequences with drafting cut off above two: no features are kept while more than two run (nothing
    drafts then); as they finish, the last two draft from the features they have (zeros before)."""
    lengths = [8, 12, 16, 24, 40]  # output lengths: the batch shrinks as they finish
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    plain = run(make_engine(target, budget=64, blocks=64, caching=False), requests)
    spec = SpeculativeConfig(method="eagle3", model=str(heads["specforge"]), num_speculative_tokens=K,
                             disable_by_batch_size=2, min_acceptance_rate=0.0)
    engine = make_engine(target, spec, budget=64, blocks=64, caching=False)
    proposer = engine.spec.proposer if engine.spec is not None else None
    assert isinstance(proposer, Eagle3Proposer)
    kept_above: list[int] = []
    inner = proposer.observe

    def observe(out) -> None:  # noqa: ANN001
        inner(out)
        if len(engine.scheduler.running) > 2:
            kept_above.append(len(proposer._feats))

    proposer.observe = observe  # type: ignore[method-assign]
    outs = run(engine, requests)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert engine.stats()["spec_num_drafts"] > 5
    assert kept_above == []  # the controller never handed a large batch's output to the head


def _edit(head: Path, out: Path, config=None, drop: str | None = None, reshape: str | None = None) -> Path:  # noqa: ANN001
    out.mkdir()
    cfg = json.loads((head / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    t = load_file(head / "model.safetensors")
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = t[reshape][:-1]
    save_file(t, out / "model.safetensors")
    return out


def test_bad_heads_fail_at_start_with_one_line(target, heads, tmp_path) -> None:
    sf = heads["specforge"]
    cases = [
        (_edit(sf, tmp_path / "vocab", config=lambda c: {**c, "vocab_size": 1000}),
         "has vocab_size=1000, the target 512"),
        (_edit(sf, tmp_path / "hidden", config=lambda c: {**c, "hidden_size": 32, "head_dim": 8}),
         "reads hidden states of size 32, the target's are 64"),
        (_edit(sf, tmp_path / "embed", config=lambda c: {**c, "hidden_size": 32, "head_dim": 8,
                                                         "target_hidden_size": 64}),
         "has hidden_size=32 and no embed_tokens.weight"),
        (_edit(sf, tmp_path / "missing", drop="midlayer.hidden_norm.weight"),
         "lacks the tensor 'midlayer.hidden_norm.weight' of a specforge EAGLE-3 head"),
        (_edit(sf, tmp_path / "shape", reshape="lm_head.weight"), "tensor 'lm_head.weight' has shape [127, 64]"),
        (_edit(sf, tmp_path / "layer", config=lambda c: {**c, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}), "reads the hidden states of layer 7, the target has 2"),
        (_edit(sf, tmp_path / "arch", config=lambda c: {**c, "architectures": ["LlamaForCausalLM"]}),
         "is not an EAGLE-3 head"),
        (_edit(heads["speculators"], tmp_path / "spec-missing", drop="layers.0.mlp.up_proj.weight"),
         "lacks the tensor 'layers.0.mlp.up_proj.weight' of a speculators EAGLE-3 head"),
    ]
    for folder, words in cases:
        with pytest.raises(ConfigError) as e:
            make_engine(target, eagle_config(folder))
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_speculators_head_loads_its_own_embedding_and_fc_bias(target, heads) -> None:
    ckpt = open_head(heads["speculators"], target)
    assert ckpt.spec.format == "speculators" and ckpt.spec.norm_before_residual
    head = ckpt.build(torch.device("cpu"), torch.float32, None, 64)
    t = load_file(heads["speculators"] / "model.safetensors")
    assert torch.equal(head.embed, t["embed_tokens.weight"]) and head.fc.bias is not None
    assert torch.equal(head.fc.bias, t["fc.bias"])
    assert torch.equal(head.draft_to_target, torch.arange(128) * 2 + 1)


def test_shipped_head_drafts_are_accepted_and_outputs_equal_plain() -> None:
    """The trained head for the default model (default auxiliary layers 2, 2, 1): most drafts accepted,
    some rejected, outputs token for token those without speculation."""
    model, head = trained_model_dir(), trained_eagle3_dir()
    assert open_head(head, model).aux_layers == (2, 2, 1)
    gen = torch.Generator().manual_seed(4)
    prompts = [[4000]] + [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in (5, 30, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = run(make_engine(model, budget=40, blocks=24), [(p, params) for p in prompts])
    engine = make_engine(model, eagle_config(head), budget=40, blocks=24)
    outs = run(engine, [(p, params) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert 0.3 < stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"] < 1.0, stats
    assert stats["spec_accepted_pos_0"] >= stats["spec_accepted_pos_1"] >= stats["spec_accepted_pos_2"] > 0


def test_startup_check_refuses_pipeline_stages_and_bad_heads(target, heads, tmp_path) -> None:
    from rtp.config import ParallelConfig, RtpConfig
    from rtp.spec.eagle3 import check_eagle3_head

    spec = eagle_config(heads["specforge"])
    check_eagle3_head(RtpConfig(speculative_config=spec), target)  # fits: no error
    with pytest.raises(ConfigError, match=r"^speculative_config.method='eagle3' is not implemented with pipeline"):
        check_eagle3_head(RtpConfig(parallel=ParallelConfig(pipeline_parallel_size=2), speculative_config=spec),
                          target)
    with pytest.raises(ConfigError, match=r"is not a checkpoint folder \(no config.json there\)"):
        check_eagle3_head(RtpConfig(speculative_config=eagle_config(tmp_path / "none")), target)


def test_feature_buffer_appends_replaces_overlaps_and_drops() -> None:
    from rtp.spec.eagle3 import FeatureBuffer

    rows = torch.arange(40, dtype=torch.float32).reshape(20, 2)  # row i = position 10 + i below
    buf = FeatureBuffer(10, rows[:3])
    for i in range(3, 20):  # one position per step, past the initial capacity
        assert buf.put(10 + i, rows[i : i + 1])
    assert torch.equal(buf.rows(), rows) and buf.first == 10
    assert buf.put(25, -rows[:2])  # a step over positions 25-26 replaces them and drops 27-29
    assert torch.equal(buf.rows(), torch.cat([rows[:15], -rows[:2]]))
    assert not buf.put(9, rows[:1]) and not buf.put(28, rows[:1])  # not touching the kept range: refused
    buf.drop_before(20)
    assert buf.first == 20 and torch.equal(buf.rows(), torch.cat([rows[10:15], -rows[:2]]))
    assert buf.put(27, rows[:1]) and buf.rows().shape[0] == 8
    buf.drop_before(100)
    assert buf.first == 28 and buf.rows().shape[0] == 0


def test_a_ranks_start_up_does_not_import_the_heads_llama_config():
    """Every rank imports the EAGLE-3 module; transformers' LlamaConfig (and the model-loading stack it pulls
    in, about a second of start-up per rank) is imported only once a head is read."""
    import subprocess
    import sys

    code = ("import sys, rtp.runtime.startup; "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_with_prefix_hits_every_draft_is_the_reference(target, heads, prompts) -> None:
    """Prompts sharing four whole blocks, three arriving together (they share blocks within the step) and two
    after four steps (hits on blocks computed before): the head's KV of the shared blocks is reused from the
    sequence that wrote it from the target's hidden states, and the last block of each hit is computed again
    (the head's KV at its last position reads the first token after the shared ones, which differs), so every
    draft equals the reference's from the whole prompt's hidden states (hit positions got zero features before)."""
    engine = make_engine(target, eagle_config(heads["specforge"]))
    shared = [prompts[3][:64] + p[:5] for p in prompts]
    seen = recording(engine)
    outs = run(engine, [(p, GREEDY) for p in shared], late=2)
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] == 4 * 48 and stats["spec_num_drafts"] > 40
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in shared]
    for tokens, room, drafts in seen[::2]:
        assert drafts == reference_drafts(hf, heads["specforge"], tokens, room), (len(tokens), room)


def test_a_blocks_reusable_head_kv_is_forgotten_once_another_sequence_writes_it(target, heads) -> None:
    """The bookkeeping behind the reuse above: the blocks sequence A's head KV filled from features are reusable by
    a sequence with A's tokens in them, until a sequence C writes the head KV of one of them without features (it
    holds the block after A, and its target hidden states never reached the proposer)."""
    proposer = make_engine(target, eagle_config(heads["specforge"])).spec.proposer
    assert isinstance(proposer, Eagle3Proposer)
    gen = torch.Generator().manual_seed(5)
    p, q = (torch.randint(0, 500, (40,), generator=gen).tolist() for _ in range(2))

    def seq(seq_id: int, tokens: list[int], table: list[int]) -> Sequence:
        s = Sequence(seq_id, tokens, GREEDY)
        s.block_table = table
        return s

    a = seq(1, p, [5, 6, 7])
    width = proposer.head.fc.full_shapes[None][1]  # the aux layers' hidden states, concatenated
    proposer.observe(StepOutput(aux_hidden=AuxHidden([1], [0], [0], torch.randn(40, width, generator=gen))))
    proposer.propose([a], [K])
    twin = seq(2, p, [5, 6, 9])
    assert proposer._reusable(twin) == 2  # the two whole blocks below position 39 (the last one reads token 32)
    assert proposer._reusable(seq(3, p[:16] + q[16:], [5, 6, 9])) == 0  # another token after block 0
    proposer.propose([seq(4, q, [5, 8, 10])], [K])  # no features: zeros written into block 5
    assert proposer._reusable(twin) == 0
    # A catch-up in several passes (a prompt above max_num_batched_tokens) records its blocks all the same.
    proposer.max_pass_tokens = 7
    proposer.observe(StepOutput(aux_hidden=AuxHidden([5], [0], [0], torch.randn(40, width, generator=gen))))
    proposer.propose([seq(5, p, [11, 12, 13])], [K])
    assert proposer._reusable(seq(6, p, [11, 12, 14])) == 2


@pytest.mark.parametrize("caching", [True, False])
def test_samples_of_a_prompt_ending_on_a_block_boundary_draft_the_reference(target, heads, prompts, caching) -> None:
    """n = 3 sampled from a 32-token prompt (two whole blocks): the samples share the prompt's blocks, but the
    head's KV at the last prompt position reads each sample's own first token, so every sample but the first
    computes the last block again in a block of its own; every draft equals the reference's. With prefix caching
    off too: the samples still share the first block, whose head KV they reuse (rewritten from zero features, it
    spoilt the first sample's drafts as well)."""
    engine = make_engine(target, eagle_config(heads["specforge"]), caching=caching)
    seen = recording(engine)
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = run(engine, [(prompts[3][:32], sampled)])
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3  # the samples differ
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert len(seen) > 20
    for tokens, room, drafts in seen:
        assert drafts == reference_drafts(hf, heads["specforge"], tokens, room), (len(tokens), room)
