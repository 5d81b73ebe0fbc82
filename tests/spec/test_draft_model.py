"""Speculative decoding with a draft model (k = 3) in one process: greedy outputs equal HF transformers'
and rtp's own without speculation, token for token, with mixed prompt lengths, chunked prefill,
preemption (a small cache) and prefix caching on; the target as its own draft has every draft accepted,
which checks the draft's KV bookkeeping (positions, preemption, prefix hits) that output equality cannot.
Also the start-up checks of ``speculative_config`` with ``method: draft_model``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rtp.config import SpeculativeConfig, load_config
from rtp.errors import ConfigError
from rtp.sampling import SamplingParams
from rtp.spec.draft_check import check_draft_model
from rtp.spec.draft_model import DraftModelProposer
from rtp.testing import TinyQwen3Spec, default_model_dir, make_tiny_qwen3
from tests.spec.drafts import noisy_draft, small_draft
from tests.spec.test_spec_engine import make_engine, run
from tests.utils import REPO, hf_greedy

K = 3
MAX_TOKENS = 48
LENGTHS = (3, 17, 40, 70, 25, 9, 33, 50)


def draft_config(model: Path, **kw) -> SpeculativeConfig:  # noqa: ANN003
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=K,
                             disable_by_batch_size=None, min_acceptance_rate=0.0, **kw)


@pytest.fixture(scope="module")
def target() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(target: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_small_cache(target: Path, spec: SpeculativeConfig | None, prompts: list[list[int]]):  # noqa: ANN201
    """20 tokens per step (prompts chunked next to other sequences' drafts), 12 blocks of 16 (preemption);
    the last prompt arrives after four steps. Returns (token lists, engine stats, engine)."""
    engine = make_engine(target, spec, budget=20, blocks=12)
    outs = run(engine, [(p, GREEDY) for p in prompts], late=1)
    return [o.token_ids for o in outs], engine.stats(), engine


def test_plain_run_equals_hf(target, prompts, expected) -> None:
    tokens, stats, _ = run_small_cache(target, None, prompts)
    assert tokens == expected and stats["num_preemptions"] > 0


@pytest.mark.parametrize("draft", ["small", "noisy"])
def test_greedy_with_draft_model_equals_hf(target, prompts, expected, draft) -> None:
    model = small_draft() if draft == "small" else noisy_draft()
    tokens, stats, _ = run_small_cache(target, draft_config(model), prompts)
    assert tokens == expected  # == HF greedy == rtp without speculation (test_plain_run_equals_hf)
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["spec_num_draft_tokens"] > 300
    if draft == "noisy":  # accepted and rejected drafts both occur
        assert 0.2 < stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"] < 0.8


def test_target_as_its_own_draft_accepts_every_draft(target, prompts, expected) -> None:
    """Identical weights: any draft KV computed at a wrong position, kept across a preemption or
    missing for a prefix-cache hit makes some drafts differ, hence rejected (seen at 0.64-0.92)."""
    tokens, stats, engine = run_small_cache(target, draft_config(target), prompts)
    assert tokens == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["spec_num_draft_tokens"] > 100
    assert stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"] >= 0.98, stats
    # Then new sequences on prefix-cache hits: blocks whose target KV exists, computed for another
    # sequence (whose draft KV may or may not be there).
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    base = prompts[3][:32]
    before = engine.stats()
    second = [base + [i] * 5 for i in range(1, 5)]
    outs = run(engine, [(second[0], GREEDY)]) + run(engine, [(p, GREEDY) for p in second[1:]])
    after = engine.stats()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in second]
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 3 * 32
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 50 and accepted / drafted >= 0.98
    proposer = engine.spec.proposer if engine.spec is not None else None
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.cpu_forward is not None  # its one-token passes ran as bound kernel calls (and were accepted)
    proposer.sync([])  # nothing runs any more: every sequence's draft state is dropped
    assert all(proposer.num_computed(i) == 0 for i in range(100))


def test_allowed_token_ids_restrict_the_drafts(target) -> None:
    """Drafts outside allowed_token_ids would always be rejected: the draft picks among the allowed."""
    allowed = [10, 11, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
    engine = make_engine(target, draft_config(target))
    plain = make_engine(target)
    prompt = [5, 6, 7, 8, 9]
    got, want = run(engine, [(prompt, params)])[0], run(plain, [(prompt, params)])[0]
    stats = engine.stats()
    assert got.token_ids == want.token_ids and set(got.token_ids) <= set(allowed)
    assert stats["spec_num_draft_tokens"] > 10 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


# ------------------------------------------------------------------ start-up checks


@pytest.fixture(scope="module")
def bad_drafts(tmp_path_factory, target: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    other_vocab = make_tiny_qwen3(root / "vocab", TinyQwen3Spec(vocab_size=640, num_hidden_layers=1))
    other_tok = root / "tokenizer"
    shutil.copytree(small_draft(), other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # swap two tokens' ids: same size, other meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    return {"vocab": other_vocab, "tokenizer": other_tok, "missing": root / "nowhere", "empty": root}


@pytest.mark.parametrize(("draft", "kw", "tp", "words"), [
    ("missing", {}, 1, "speculative_config.model='{path}' is not a Hugging Face checkpoint folder"),
    ("empty", {}, 1, "is not a Hugging Face checkpoint folder (no config.json there)"),
    ("vocab", {}, 1, "has vocab_size=640, the target 512: the draft must share the target's vocabulary"),
    ("tokenizer", {}, 1, "has another tokenizer than the target (454 vs 454 tokens; e.g."),
    ("small", {"draft_tensor_parallel_size": 3}, 2,
     "speculative_config.draft_tensor_parallel_size=3 is invalid: expected 1 or the target's tensor-parallel size 2"),
    ("small", {"draft_tensor_parallel_size": 2}, 2,
     "speculative_config.draft_tensor_parallel_size=2 (the target's TP size) is not implemented yet"),
])
def test_draft_model_checks_fail_in_one_line(target, bad_drafts, draft, kw, tp, words) -> None:
    path = small_draft() if draft == "small" else bad_drafts[draft]
    with pytest.raises(ConfigError) as e:
        check_draft_model(draft_config(path, **kw), target, tp)
    message = str(e.value)
    assert words.format(path=path) in message and "\n" not in message


def test_draft_model_checks_pass_for_a_good_draft(target) -> None:
    check_draft_model(draft_config(small_draft()), target, 2)
    check_draft_model(draft_config(small_draft(), draft_tensor_parallel_size=1), target, 1)


@pytest.mark.parametrize(("text", "words"), [
    ("{method: draft_model, num_speculative_tokens: 3}",
     "model=None is invalid: expected a draft checkpoint folder path with "
     "speculative_config.method='draft_model'"),
    ("{method: draft_model, model: /m, num_speculative_tokens: 0}", "speculative_config.num_speculative_tokens=0"),
    ("{method: draft_model, model: /m}", "num_speculative_tokens=None is invalid"),
    ("{method: draft_model, model: /m, num_speculative_tokens: 2, draft_tensor_parallel_size: 0}",
     "speculative_config.draft_tensor_parallel_size=0 is invalid"),
])
def test_draft_model_config_errors_name_the_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"speculative_config: {text}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_make_layer_draft_keeps_the_first_layers(target, tmp_path) -> None:
    """scripts/make_layer_draft.py: the cut checkpoint computes what the target's first layer computes."""
    out = tmp_path / "cut"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_layer_draft.py"), str(target), str(out),
                    "--layers", "1"], check=True, capture_output=True)
    check_draft_model(draft_config(out), target, 1)  # same vocabulary and tokenizer
    cut = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert cut.config.num_hidden_layers == 1 < full.config.num_hidden_layers
    full.model.layers = full.model.layers[:1]
    full.config.num_hidden_layers = 1
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, full(ids).logits)
