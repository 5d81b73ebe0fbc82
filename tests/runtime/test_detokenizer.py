"""IncrementalDetokenizer and TokenDecoder against one-shot tokenizer.decode: multi-byte text, specials, stops."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rtp.runtime.detokenizer import IncrementalDetokenizer, TokenDecoder
from rtp.sampling import SamplingParams
from rtp.testing import default_model_dir

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the quick brown fox jumps over a lazy dog while rain falls on quiet streets "
    "你好 世界 今天 天气 很好 我们 去 公园 散步 吧 東京 大阪 日本語 한국어 안녕하세요 "
    "😀 😃 🚀 🌍 ✨ 🎉 👍🏽 Grüße Köln naïve café — … ½ € Ω"
).split()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE: few merges, so multi-byte characters often span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 3 + ["the fox and the dog " * 20, "你好世界 " * 10]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0])
    hf.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return hf


def random_text(rng: random.Random, num_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", "", " ", "\n"]) for _ in range(num_words))


def stream(
    tokenizer: PreTrainedTokenizerFast, ids: list[int], params: SamplingParams, prompt: list[int] | None = None
) -> tuple[IncrementalDetokenizer, list[str], int | None]:
    """Feed ids one by one; returns the detokenizer, all deltas (flush last) and the stopping index.

    Checks on the way that everything emitted so far stays a prefix of the
    final text and that held-back text is bounded by the longest stop string.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt or [], params)
    deltas: list[str] = []
    stopped_at = None
    max_hold = max((len(s) - 1 for s in params.stop_strings), default=0)
    for i, token in enumerate(ids):
        delta, stopped = detok.add(token)
        deltas.append(delta)
        emitted = "".join(deltas)
        assert detok.text.startswith(emitted)
        assert len(detok.text) - len(emitted) <= max_hold
        if stopped:
            stopped_at = i
            break
    deltas.append(detok.flush())
    final = "".join(deltas)
    assert final == detok.text
    # Nothing emitted mid-stream may be missing from (or differ in) the final text.
    running = ""
    for d in deltas:
        running += d
        assert final.startswith(running)
    return detok, deltas, stopped_at


def test_fixture_splits_multibyte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("🚀你好世界😀", add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_one_shot_decode(tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    rng = random.Random(0 if skip_special_tokens else 1)
    vocab = len(tokenizer)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        prompt = tokenizer.encode(random_text(rng, 3), add_special_tokens=False) if rng.random() < 0.5 else []
        detok, deltas, stopped_at = stream(tokenizer, ids, params, prompt)
        assert stopped_at is None
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_valid_multibyte_text_never_emits_replacement(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(2)
    held = 0
    for _ in range(50):
        text = random_text(rng, 12)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = tokenizer.encode("<|im_start|>user\n" + random_text(rng, 2), add_special_tokens=False)
        _, deltas, _ = stream(tokenizer, ids, SamplingParams(), prompt)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == text
        held += sum(d == "" for d in deltas[:-1])
    assert held > 0  # some tokens really did end inside a character


def test_special_tokens_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("你好<|im_end|>\n<|im_start|>🚀", add_special_tokens=False)
    _, kept, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(kept) == "你好<|im_end|>\n<|im_start|>🚀"
    _, skipped, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=True))
    assert "".join(skipped) == "你好\n🚀"


def reference_stop(
    tokenizer: PreTrainedTokenizerFast, ids: list[int], stops: list[str], keep: bool = False, min_tokens: int = 0
) -> tuple[str, int | None]:
    """Text and stopping token index the way a generation loop would see it, by re-decoding every prefix
    (``keep``: include_stop_str_in_output, the earliest match's stop string kept, the first listed on a tie;
    ``min_tokens``: stop strings count from that token on, and only where they start after the text before it)."""
    before = tokenizer.decode(ids[: min_tokens - 1], skip_special_tokens=True) if min_tokens > 1 else ""
    floor = len(before.rstrip("\ufffd"))
    for k in range(max(1, min_tokens), len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        found = [(text.find(s, floor), i) for i, s in enumerate(stops) if text.find(s, floor) >= 0]
        if found:
            pos, i = min(found)
            return text[: pos + len(stops[i]) if keep else pos], k - 1
    return tokenizer.decode(ids, skip_special_tokens=True), None


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the quick brown fox jumps over a lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "fox jumps"
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    detok, deltas, stopped_at = stream(tokenizer, ids, SamplingParams(stop=stop))
    assert detok.stopped and stopped_at is not None
    assert detok.text == "the quick brown "
    assert stopped_at < len(ids) - 1
    assert "".join(deltas) == "the quick brown "
    assert (detok.text, stopped_at) == reference_stop(tokenizer, ids, [stop])


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("the quick brown fox jumps over a lazy dog", add_special_tokens=False)
    params = SamplingParams(stop=["lazy", "fox jumps"], include_stop_str_in_output=True)
    detok, deltas, stopped_at = stream(tokenizer, ids, params)
    assert detok.stopped and detok.text == "".join(deltas) == "the quick brown fox jumps"
    assert stopped_at == reference_stop(tokenizer, ids, ["fox jumps"])[1]


def test_stop_string_at_the_start(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("你好世界 the dog", add_special_tokens=False)
    detok, deltas, stopped_at = stream(tokenizer, ids, SamplingParams(stop=["好", "dog"]))
    assert detok.text == "你"
    detok, deltas, stopped_at = stream(tokenizer, ids, SamplingParams(stop=["你好世"]))
    assert detok.text == "" and all(d == "" for d in deltas) and detok.stopped
    assert stopped_at == reference_stop(tokenizer, ids, ["你好世"])[1]


def test_no_stop_match_emits_everything_after_flush(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the dog jumps over the fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, stopped_at = stream(tokenizer, ids, SamplingParams(stop=["the cat", "fox!"]))
    assert stopped_at is None and not detok.stopped
    assert "".join(deltas[:-1]) == "the dog jumps over the "  # "fox" might still become "fox!"
    assert deltas[-1] == "fox"


def test_random_stop_strings_match_reference(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(3)
    for _ in range(120):
        text = random_text(rng, 10)
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7:
                start = rng.randrange(len(text))
                stops.append(text[start : start + rng.randint(1, 6)])
            else:
                stops.append(random_text(rng, 2).strip() or "x")
        keep = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2, 3, 5])
        params = SamplingParams(stop=stops, include_stop_str_in_output=keep, min_tokens=min_tokens)
        detok, deltas, stopped_at = stream(tokenizer, ids, params)
        expected_text, expected_index = reference_stop(tokenizer, ids, stops, keep, min_tokens)
        assert (detok.text, stopped_at) == (expected_text, expected_index), (text, stops, keep, min_tokens)
        assert "".join(deltas) == detok.text
        assert detok.stopped == (expected_index is not None)
        # No emitted text contains any part of the stop string that matched.
        assert "".join(deltas) == expected_text


def test_a_partial_stop_string_begun_before_min_tokens_is_not_held_back(tokenizer: PreTrainedTokenizerFast) -> None:
    """Text before the min_tokens point cannot be part of a stop string: once emitted it stays emitted, even when
    the next token would complete a stop string that started before that point."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "abcdabc"]
    assert tokenizer.decode(ids) == "abcdabc"
    detok, deltas, stopped_at = stream(tokenizer, ids, SamplingParams(stop=["abc"], min_tokens=2))
    assert deltas[:2] == ["a", "b"] and stopped_at == 6 and detok.text == "abcd"
    assert (detok.text, stopped_at) == reference_stop(tokenizer, ids, ["abc"], min_tokens=2)


def test_add_after_stop_is_inert(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("the dog and the fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="dog"))
    results = [detok.add(t) for t in ids]
    assert any(stopped for _, stopped in results)
    assert detok.text == "the "
    assert results[-1] == ("", True)
    assert detok.flush() == ""


def test_prompt_context_keeps_leading_space() -> None:
    """A Metaspace tokenizer drops the leading space of a decode; the prompt context prevents that."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world the dog and the fox " * 10], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    prompt = hf.encode("hello the", add_special_tokens=False)
    ids = hf.encode("dog and the fox", add_special_tokens=False)
    expected = hf.decode(prompt + ids)[len(hf.decode(prompt)) :]
    assert expected.startswith(" ") and not hf.decode(ids).startswith(" ")
    _, deltas, _ = stream(hf, ids, SamplingParams(), prompt)
    assert "".join(deltas) == expected
    # Without a prompt there is nothing to continue from, like a one-shot decode.
    _, deltas, _ = stream(hf, ids, SamplingParams(), [])
    assert "".join(deltas) == hf.decode(ids)


# ---- TokenDecoder: the fast path against Hugging Face decode, on the tiny model's tokenizer ----


@pytest.fixture(scope="module")
def model_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny test model's own tokenizer (Qwen2, byte-level BPE, with special tokens)."""
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def model_ids(tok: PreTrainedTokenizerFast, rng: random.Random, n: int) -> list[int]:
    """Random ids mixing arbitrary tokens (often parts of a character), encoded multi-byte text and special tokens."""
    specials = sorted(tok.all_special_ids)
    out: list[int] = []
    while len(out) < n:
        pick = rng.random()
        if pick < 0.4:
            out.append(rng.randrange(len(tok)))
        elif pick < 0.55:
            out.append(rng.choice(specials))
        else:
            out.extend(tok.encode(rng.choice(WORDS) + rng.choice(["", " "]), add_special_tokens=False))
    return out[:n]


def test_model_tokenizer_takes_the_fast_paths(model_tokenizer: PreTrainedTokenizerFast) -> None:
    decoder = TokenDecoder(model_tokenizer)
    assert decoder.uses_backend and decoder.additive
    # Multi-byte characters really do span tokens, and there are special tokens to skip.
    assert any(model_tokenizer.decode([i]).endswith("\ufffd") for i in model_tokenizer.encode("你好🚀"))
    assert model_tokenizer.all_special_ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_token_decoder_matches_hf_decode(model_tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    decoder = TokenDecoder(model_tokenizer)
    rng = random.Random(10 + skip_special_tokens)
    texts = set()
    for _ in range(400):
        ids = model_ids(model_tokenizer, rng, rng.randint(1, 12))
        expected = model_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert decoder.decode(ids, skip_special_tokens) == expected, ids
        assert decoder.decode(ids[:1], skip_special_tokens) == model_tokenizer.decode(
            ids[:1], skip_special_tokens=skip_special_tokens
        )
        texts.add(expected)
    joined = "".join(texts)
    assert "\ufffd" in joined and "你" in joined and ("<|" in joined) != skip_special_tokens


def test_byte_level_decode_is_additive_at_character_boundaries(model_tokenizer: PreTrainedTokenizerFast) -> None:
    """What the no-decode path of IncrementalDetokenizer relies on, checked against the installed tokenizers."""
    rng = random.Random(12)
    checked = 0
    for _ in range(600):
        a = model_ids(model_tokenizer, rng, rng.randint(1, 6))
        b = model_ids(model_tokenizer, rng, rng.randint(1, 6))
        skip = rng.random() < 0.5
        text_a = model_tokenizer.decode(a, skip_special_tokens=skip)
        if text_a.endswith("\ufffd"):
            continue
        checked += 1
        assert model_tokenizer.decode(a + b, skip_special_tokens=skip) == text_a + model_tokenizer.decode(
            b, skip_special_tokens=skip
        ), (a, b, skip)
    assert checked > 200


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_model_tokenizer_stream_matches_one_shot_decode(
    model_tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(20 + skip_special_tokens)
    decoder = TokenDecoder(model_tokenizer)  # shared by all streams, as in the engine
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    held = 0
    for _ in range(200):
        ids = model_ids(model_tokenizer, rng, rng.randint(1, 40))
        prompt = model_ids(model_tokenizer, rng, rng.randint(1, 8)) if rng.random() < 0.7 else []
        for tok in (decoder, model_tokenizer):
            _, deltas, stopped_at = stream(tok, ids, params, prompt)  # type: ignore[arg-type]
            assert stopped_at is None
            expected = model_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if prompt and not model_tokenizer.decode(prompt[-6:], skip_special_tokens=skip_special_tokens).endswith(
                "\ufffd"
            ):
                # Continuing from the prompt: the output's text is what it adds to the prompt's.
                full = model_tokenizer.decode(prompt[-6:] + ids, skip_special_tokens=skip_special_tokens)
                ctx = model_tokenizer.decode(prompt[-6:], skip_special_tokens=skip_special_tokens)
                expected = full[len(ctx) :]
            assert "".join(deltas) == expected, (prompt, ids)
            held += sum(d == "" for d in deltas[:-1])
    assert held > 0  # some tokens ended inside a character (the window path ran, not only the memo)


def test_stop_strings_on_model_tokenizer_match_reference(model_tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(30)
    decoder = TokenDecoder(model_tokenizer)
    for _ in range(100):
        text = random_text(rng, 10)
        ids = model_tokenizer.encode(text, add_special_tokens=False)
        start = rng.randrange(len(text))
        stops = [text[start : start + rng.randint(1, 5)], "zz"]
        detok, deltas, stopped_at = stream(decoder, ids, SamplingParams(stop=stops))  # type: ignore[arg-type]
        assert (detok.text, stopped_at) == reference_stop(model_tokenizer, ids, stops), (text, stops)


def test_overridden_decode_falls_back_to_the_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    """A tokenizer class with its own decode may do more than the Rust decode: it is called as it is."""

    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):  # type: ignore[no-untyped-def, override]
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer)
    decoder = TokenDecoder(shouting)
    assert not decoder.uses_backend and not decoder.additive
    ids = tokenizer.encode("the quick 你好 fox", add_special_tokens=False)
    _, deltas, _ = stream(shouting, ids, SamplingParams())
    assert "".join(deltas) == "THE QUICK 你好 FOX"
