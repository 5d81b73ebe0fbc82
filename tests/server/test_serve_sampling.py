"""Sampling features through a TP=2 server and the official openai client: echo + logprobs against HF
transformers, n > 1 against separate seeded requests (also streamed), penalties and logit_bias."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import kill, launch, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_sampling")
    config = tmp / "cpu.yaml"
    config.write_text(f"model: {default_model_dir()}\ndevice: cpu\ndtype: float32\nblock_size: 16\n"
                      "max_num_seqs: 32\nmax_num_batched_tokens: 512\ncpu_kv_cache_gib: 0.1\nenforce_eager: true\n"
                      "log_level: INFO\n")
    server = launch(tmp, "sampling", config)
    try:
        wait_ready(server)
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        kill(server)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.timeout(300)
def test_echo_logprobs_equal_hf_log_softmax(client, model):
    model_dir = default_model_dir()
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # [len, vocab]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4, i
        assert 1 <= len(lp.top_logprobs[i]) <= 3  # the top two and the prompt's token, keyed by text
        assert lp.top_logprobs[i][lp.tokens[i]] >= lp.token_logprobs[i]  # two ids of one text: the likelier one's
        assert abs(max(lp.top_logprobs[i].values()) - ref[i - 1].max().item()) < 1e-4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(PROMPT)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    # max_tokens 0 with echo (scoring the prompt, as lm-eval's loglikelihood requests do): the prompt alone, with
    # the same logprobs, nothing generated; streamed as one chunk.
    for stream in (False, True):
        kw = {"model": model, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            (choice,) = [c.choices[0] for c in chunks if c.choices]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(**kw)
            choice, usage = r.choices[0], r.usage
        assert choice.text == PROMPT and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        assert all(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4 for i in range(1, len(ids)))
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == 0
    two = client.completions.create(model=model, prompt=[PROMPT, "Once upon"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [PROMPT, PROMPT, "Once upon", "Once upon"]
    assert two.usage.completion_tokens == 0


@pytest.mark.timeout(300)
def test_chat_prompt_logprobs_are_the_templated_prompts_as_hf(client, model):
    """vLLM's chat prompt_logprobs: the response's, beside the choices, for the prompt the chat template made
    (refused with stream: true, as vLLM's)."""
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    messages = [{"role": "user", "content": PROMPT}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    assert r.usage.prompt_tokens == len(ids) == len(plp) and plp[0] is None
    for i in range(1, len(ids)):
        assert abs(plp[i][str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 1})


def test_prompt_logprobs_equal_hf_and_top_logprobs_name_the_sampled_token(client, model):
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # [len, vocab]
    for stream in (False, True):
        kw = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "extra_body": {"prompt_logprobs": 2}}
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
            plp = [c.model_extra.get("prompt_logprobs") for c in chunks]
            assert plp[0] is not None and all(p is None for p in plp[1:]), "in the first chunk only"
            plp = plp[0]
        else:
            plp = client.completions.create(**kw).choices[0].model_extra["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            assert str(ids[i]) in entry and abs(entry[str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
            top = ref[i - 1].topk(2)
            ranked = sorted(entry.values(), key=lambda v: v["rank"])[:2]
            assert [v["rank"] for v in ranked] == [1, 2]
            assert all(abs(v["logprob"] - t.item()) < 1e-4 for v, t in zip(ranked, top.values, strict=True))
            row, lp = ref[i - 1], ref[i - 1, ids[i]]  # the prompt token's rank: the tokens at least as likely
            assert (row > lp + 1e-4).sum().item() < entry[str(ids[i])]["rank"] <= (row >= lp - 1e-4).sum().item()
            assert len(entry) == 2 + (ids[i] not in top.indices.tolist())
            assert entry[str(ids[i])]["decoded_token"] == tok.decode([ids[i]])
    # Sampled: each position's top_logprobs name the sampled token beside the likeliest one (OpenAI's shape).
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert any(max(t.values()) > lp.token_logprobs[i] for i, t in enumerate(lp.top_logprobs)), "a non-top token"
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] >= logprob and 1 <= len(top) <= 2  # two ids of one text: the likelier one's
    assert sum(top[token] == logprob for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)) > 8


@pytest.mark.timeout(300)
def test_n_choices_equal_separate_seeded_requests_and_stream(client, model):
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    r = client.completions.create(n=3, seed=7, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    singles = [client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert texts == singles
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    streamed = ["", "", ""]
    finished = [0, 0, 0]
    for chunk in client.completions.create(n=3, seed=7, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finished[c.index] += c.finish_reason is not None
    assert streamed == texts and finished == [1, 1, 1]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
                                          max_tokens=6, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 12
    # A chat stream of n choices opens each with one role chunk (carrying the echoed message): the text streamed
    # equals the text returned whole.
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Good morrow"}]
    kw = {"model": model, "messages": msgs, "n": 3, "seed": 3, "max_tokens": 6, "temperature": 1.0,
          "extra_body": {"echo": True, "continue_final_message": True, "add_generation_prompt": False}}
    whole = [c.message.content for c in sorted(client.chat.completions.create(**kw).choices, key=lambda c: c.index)]
    roles, streamed = [0, 0, 0], ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            roles[c.index] += c.delta.role is not None
            streamed[c.index] += c.delta.content or ""
    assert roles == [1, 1, 1] and streamed == whole and all(t.startswith("Good morrow") for t in whole)


@pytest.mark.timeout(300)
def test_penalties_and_logit_bias(client, model):
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    forced = tok.encode(" fox", add_special_tokens=False)[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                  logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].text == tok.decode([forced] * 4)
    base = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    plain = client.completions.create(**base).choices[0].text
    penalised = client.completions.create(presence_penalty=2.0, frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5}, **base).choices[0].text
    assert plain != penalised
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"99999999": 1})
