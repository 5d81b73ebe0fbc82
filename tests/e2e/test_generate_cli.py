"""launch/generate.py rejects bad JSONL lines with their line number, before starting any rank."""

import json
import subprocess
import sys

import pytest

from tests.utils import REPO

BAD_LINES = [
    ("not json", "2:"),
    (json.dumps([1, 2]), "expected a JSON object"),
    (json.dumps({"prompt": "a", "prompt_token_ids": [1]}), "exactly one of"),
    (json.dumps({"prompt": "a", "temprature": 0.5}), "temprature"),
    (json.dumps({"prompt": "a", "max_tokens": -1}), "max_tokens"),
    (json.dumps({"prompt": "a", "top_p": "high"}), "top_p"),
    (json.dumps({"prompt": ""}), "non-empty string"),
    (json.dumps({"prompt": None}), "non-empty string"),
    (json.dumps({"prompt_token_ids": "text"}), "list of integers"),
]


@pytest.mark.parametrize("line, words", BAD_LINES)
def test_bad_line_is_reported_with_its_number(tmp_path, line, words):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    proc = subprocess.run([sys.executable, "launch/generate.py", "--prompts-file", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"{path}:2:" in proc.stderr and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_prompt_the_model_cannot_take_is_reported_with_its_line(tmp_path):
    """Token ids out of the vocabulary are only known once the model is loaded; the line is still named."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps({"prompt_token_ids": [1, 10**6]}) + "\n")
    proc = subprocess.run([sys.executable, "launch/generate.py", "--prompts-file", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1
    assert f"{path}:3: token id 1000000 is out of range" in proc.stderr, proc.stderr


@pytest.mark.timeout(300)
def test_every_sample_and_the_prompt_logprobs_reach_the_output_file(tmp_path):
    # One rank (plain python), the default trained model; n = 3 seeded samples and prompt logprobs.
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps({"prompt": "If music be the food of love", "n": 3, "seed": 5, "temperature": 1.0,
                                "max_tokens": 6, "prompt_logprobs": 1, "logprobs": 1}) + "\n"
                    + json.dumps({"prompt": "Now is the winter", "max_tokens": 4}) + "\n"
                    + json.dumps({"prompt": "To be", "ignore_eos": True}) + "\n")  # --max-tokens: its max_tokens
    proc = subprocess.run([sys.executable, "launch/generate.py", "--prompts-file", str(path), "--output", str(out),
                           "--max-tokens", "3"], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    first, second, third = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(second["token_ids"]) <= 4 and len(third["token_ids"]) == 3
    samples = first["outputs"]
    assert [s["index"] for s in samples] == [0, 1, 2]
    assert all(len(s["token_ids"]) == 6 and len(s["logprobs"]) == 6 for s in samples)
    assert {k: samples[0][k] for k in ("token_ids", "text", "finish_reason")} == {
        k: first[k] for k in ("token_ids", "text", "finish_reason")}
    assert len({tuple(s["token_ids"]) for s in samples}) > 1  # three seeds, not one sample written thrice
    lps = first["prompt_logprobs"]
    assert lps[0] is None and len(lps) > 1 and all(isinstance(d, dict) and d for d in lps[1:])
    assert "outputs" not in second and "prompt_logprobs" not in second
    for s in samples:  # JSON keys are strings
        assert s["cumulative_logprob"] == pytest.approx(sum(e[str(t)] for t, e in zip(s["token_ids"], s["logprobs"])))
    assert second["stop_reason"] is None and "cumulative_logprob" not in second


@pytest.mark.timeout(300)
def test_demo_prints_the_greedy_continuation_and_a_seeded_sample_of_each_prompt():
    """Without --prompts-file: each built-in prompt's greedy line equals transformers' greedy decoding of the
    shipped model, and a sample (temperature 0.8, top_p 0.95, seed 0) is printed beside it."""
    import ast
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rtp.assets import trained_model_dir
    from rtp.entrypoints.generate import DEMO_PROMPTS
    from tests.utils import hf_greedy

    proc = subprocess.run([sys.executable, "launch/generate.py", "--max-tokens", "8", "--dtype", "float32"],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^('.*')\n  greedy:  ('.*'|\".*\") \((\w+)\)\n  sampled: ('.*'|\".*\") \((\w+); (.*)\)$",
                       proc.stdout, re.MULTILINE)
    assert [ast.literal_eval(f[0]) for f in found] == DEMO_PROMPTS, proc.stdout
    model = AutoModelForCausalLM.from_pretrained(trained_model_dir(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    greedy, sampled = [], []
    for prompt, text, reason, sample, _, settings in found:
        want = tok.decode(hf_greedy(model, tok.encode(ast.literal_eval(prompt)), 8))
        text = ast.literal_eval(text)
        # An EOS ends the greedy line early ("stop"); transformers' continuation here never stops.
        assert text == want if reason == "length" else (reason == "stop" and want.startswith(text)), (text, want)
        assert settings == "temperature 0.8, top_p 0.95, seed 0"
        greedy.append(text)
        sampled.append(ast.literal_eval(sample))
    assert sampled != greedy  # the sample is drawn, not a second greedy line
