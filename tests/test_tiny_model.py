"""The generated tiny Qwen3 checkpoint loads in HF transformers, is deterministic and is usable."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Prove that nothing is fetched from a hub: set before transformers is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import rtp.testing as rtp_testing  # noqa: E402
from rtp.testing import TinyQwen3Spec, default_model_dir, make_tiny_qwen3  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LINEAR = {"rope_type": "linear", "factor": 2.0}
PROMPTS = ["The weather today is", "Once upon a time", "def main():", "Grüße, 世界! 🙂", "1 2 3 4"]
TEXTS = [
    "Hello world!",
    "naïve café — 日本語 🙂\n\n  tabs\tand  spaces",
    "<|im_start|>user\nhi<|im_end|>\n",
    "\x00\x7f",
]


def _read_tensors(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file name, tensor) over every safetensors file in the folder."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} stored twice"
                out[name] = (path.name, f.get_tensor(name))
    return out


@pytest.fixture(scope="module")
def default_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("default"))


@pytest.mark.parametrize(
    "spec",
    [
        TinyQwen3Spec(),
        TinyQwen3Spec(tie_word_embeddings=False, num_shards=3),
        TinyQwen3Spec(num_shards=2, rope_scaling=LINEAR, seed=5),
        TinyQwen3Spec(tie_word_embeddings=False, rope_scaling=LINEAR, num_hidden_layers=3),
    ],
    ids=["tied", "untied-3shards", "tied-2shards-linear", "untied-linear"],
)
def test_hf_loads_checkpoint(tmp_path: Path, spec: TinyQwen3Spec) -> None:
    folder = make_tiny_qwen3(tmp_path / "ckpt", spec)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.model_type == "qwen3" and config.vocab_size == spec.vocab_size
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling or {}
    if spec.rope_scaling is not None:
        assert rope["rope_type"] == "linear" and rope["factor"] == 2.0
    else:
        assert rope.get("rope_type", "default") == "default"

    model, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    stored = _read_tensors(folder)
    # Tied checkpoints store no lm_head.weight, like published tied Qwen3 files.
    expected = set(state) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    assert set(stored) == expected
    for name, (_, tensor) in stored.items():
        assert torch.equal(state[name], tensor), name
    if spec.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"][1])

    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if spec.num_shards == 1:
        assert files == ["model.safetensors"] and not (folder / "model.safetensors.index.json").exists()
    else:
        assert files == [f"model-{i:05d}-of-{spec.num_shards:05d}.safetensors" for i in range(1, spec.num_shards + 1)]
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {name: fname for name, (fname, _) in stored.items()}
        total = sum(t.numel() * t.element_size() for _, t in stored.values())
        assert index["metadata"]["total_size"] == total


def test_tokenizer(default_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_ckpt, local_files_only=True)
    raw = Tokenizer.from_file(str(default_ckpt / "tokenizer.json"))
    spec = TinyQwen3Spec()
    assert 400 <= len(tok) <= spec.vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tid = tok.convert_tokens_to_ids(special)
        assert tid == raw.token_to_id(special) and 0 <= tid < spec.vocab_size
        assert special in tok.all_special_tokens
    config = json.loads((default_ckpt / "config.json").read_text())
    generation = json.loads((default_ckpt / "generation_config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id and tok.eos_token_id in generation["eos_token_id"]
    for text in TEXTS + PROMPTS:
        ids = tok(text)["input_ids"]
        # The HF tokenizer class rebuilds the pipeline; it must agree with tokenizer.json.
        assert ids == raw.encode(text).ids
        assert max(ids) < spec.vocab_size
        assert tok.decode(ids) == text and raw.decode(ids, skip_special_tokens=False) == text
    sentence = "The children ran home from school in the evening, and the weather was cold."
    pieces = [tok.decode([i]) for i in tok(sentence)["input_ids"]]
    # Ordinary English becomes multi-character tokens, not one token per byte.
    assert len(sentence) / len(pieces) > 2.0 and sum(len(p.strip()) >= 3 for p in pieces) >= 8


def test_chat_template(default_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_ckpt, local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tok.apply_chat_template(messages, tokenize=False) == body
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == body + "<|im_start|>assistant\n"
    ids = tok(rendered)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_deterministic(tmp_path: Path) -> None:
    spec = TinyQwen3Spec(num_shards=2, tie_word_embeddings=False)
    first = _files(make_tiny_qwen3(tmp_path / "a", spec))
    assert first == _files(make_tiny_qwen3(tmp_path / "b", spec))
    # A fresh process (new hash seeds, new tokenizer training) through the CLI.
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_qwen3.py"), str(tmp_path / "c"), "--num-shards", "2",
         "--no-tie"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    assert Path(out.stdout.strip()) == tmp_path / "c"
    assert first == _files(tmp_path / "c")
    other = _files(make_tiny_qwen3(tmp_path / "d", TinyQwen3Spec(num_shards=2, tie_word_embeddings=False, seed=1)))
    assert other.keys() == first.keys()
    assert other["tokenizer.json"] == first["tokenizer.json"]
    for name in first:
        if name.endswith(".safetensors"):
            assert other[name] != first[name], name


def test_greedy_outputs_vary(default_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(default_ckpt, local_files_only=True, dtype=torch.float32).eval()
    continuations = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")["input_ids"]  # [1, prompt_len]
            new: list[int] = []
            for _ in range(32):  # greedy, full recompute each step: no cache, no stopping
                logits = model(ids).logits[0, -1]  # [vocab_size]
                assert torch.isfinite(logits).all()
                assert 0.3 < logits.std().item() < 20.0 and logits.abs().max().item() < 100.0
                nxt = int(logits.argmax())
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            assert len(set(new)) >= 8, (prompt, new)
            continuations.append(tuple(new))
    assert len(set(continuations)) == len(PROMPTS)


def test_invalid_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_qwen3(tmp_path, TinyQwen3Spec(vocab_size=300))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        make_tiny_qwen3(tmp_path, TinyQwen3Spec(num_attention_heads=4, num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_shards"):
        make_tiny_qwen3(tmp_path, TinyQwen3Spec(num_shards=1000))
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_qwen3(tmp_path, dtype=torch.int8)
    assert not any(tmp_path.iterdir())  # validation happens before anything is written


def test_default_model_dir_concurrent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "cache")
    # Spawned workers import only rtp.testing (the task is a reference to
    # default_model_dir), so they start quickly and build at about the same time.
    with mp.get_context("spawn").Pool(3) as pool:
        paths = pool.map(default_model_dir, [root] * 3, chunksize=1)
    assert len(set(paths)) == 1
    folder = Path(paths[0])
    assert [p.name for p in Path(root).iterdir()] == [folder.name]  # no temporary folders left behind
    assert _files(folder) == _files(make_tiny_qwen3(tmp_path / "ref"))

    # Already built: returned as is, nothing rebuilt; $RTP_CACHE_DIR is the fallback root.
    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt an existing default model")

    monkeypatch.setattr(rtp_testing, "make_tiny_qwen3", no_build)
    monkeypatch.setenv("RTP_CACHE_DIR", root)
    assert default_model_dir() == folder


def test_default_model_dir_lost_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_build = rtp_testing.make_tiny_qwen3
    winner: list[Path] = []

    def build_and_race(out_dir, *args, **kwargs):
        # Another process finishes first, between our build and our rename.
        real_build(out_dir, *args, **kwargs)
        final = tmp_path / f"tiny-qwen3-{rtp_testing.spec_digest(TinyQwen3Spec())}"
        real_build(final, *args, **kwargs)
        (final / "winner").write_text("")
        winner.append(final)

    monkeypatch.setattr(rtp_testing, "make_tiny_qwen3", build_and_race)
    got = default_model_dir(tmp_path)
    assert winner and got == winner[0] and (got / "winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == [got.name]


def test_default_model_dir_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir, *args, **kwargs):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(rtp_testing, "make_tiny_qwen3", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model_dir(tmp_path)
    assert not any(tmp_path.iterdir())
