"""The shipped trained model (rtp/assets/qwen3-tiny-shakespeare): real HF files, rtp's default, same as HF.

Greedy generation through rtp's whole path (launch/generate.py under torchrun, the default
model, fp32 compute from bf16 weights) at TP = 1 and 2 equals transformers token for token.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.assets import trained_model_dir
from rtp.testing import ENDOFTEXT, IM_END, build_tokenizer
from tests.utils import REPO, hf_greedy

MODEL = trained_model_dir()
# Openings from the corpus and plain modern English the model never saw.
PROMPTS = ["If music be the food of love,", "To be, or not to be:", "KING HENRY V:\nOnce more unto the breach,",
           "The weather is fine today, and"]
STEPS = 24


@pytest.fixture(scope="module")
def hf():
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(MODEL))


def test_shipped_files_load_with_transformers_unchanged(hf):
    model, info = AutoModelForCausalLM.from_pretrained(MODEL, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    files = sorted(p.name for p in MODEL.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in MODEL.iterdir()) < 10 * 2**20
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}

    _, tok = hf
    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name; 1599 <think>"
    assert tok.encode(text) == raw.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == IM_END and tok.convert_tokens_to_ids(ENDOFTEXT) == 4000
    chat = tok.apply_chat_template([{"role": "user", "content": "Speak."}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat.startswith("<|im_start|>user\nSpeak.<|im_end|>")


def test_added_tokens_are_rtps_on_the_reserved_ids():
    """The exported tokenizer carries rtp's current added tokens (same content, kind and order) from id 4000."""
    mine = Tokenizer.from_file(str(MODEL / "tokenizer.json")).get_added_tokens_decoder()
    ref = build_tokenizer().get_added_tokens_decoder()
    want = [(ENDOFTEXT, True)] + [(t.content, t.special) for _, t in sorted(ref.items()) if t.content != ENDOFTEXT]
    assert [(mine[i].content, mine[i].special) for i in sorted(mine)] == want
    assert min(mine) == 4000


def test_the_model_is_trained_on_english(hf):
    """Lower loss on English than on the same tokens shuffled: the weights learned word order."""
    model, tok = hf
    text = ("Now is the winter of our discontent made glorious summer by this sun of York; "
            "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried.")
    ids = tok.encode(text)
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    with torch.no_grad():
        nll = [model(input_ids=torch.tensor([x]), labels=torch.tensor([x])).loss.item() for x in (ids, shuffled)]
    assert nll[0] < nll[1] - 1.5, nll


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_generation_equals_transformers(tp, hf, tmp_path):
    model, tok = hf
    want = [hf_greedy(model, tok.encode(p), STEPS) for p in PROMPTS]
    assert len(set().union(*want)) >= 8, "a continuation of one repeated token would prove little"
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"prompt": p, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}) + "\n"
        for p in PROMPTS))
    # No --model: the trained model is the default. The shipped config, in float32 (as HF runs here).
    config = tmp_path / "cpu.yaml"
    config.write_text((REPO / "configs" / "cpu.yaml").read_text().replace("\ndtype: auto\n", "\ndtype: float32\n"))
    assert "dtype: float32" in config.read_text()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "launch/generate.py", "--config", str(config), "--prompts-file", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=380,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"from {MODEL}:" in proc.stderr, proc.stderr[-3000:]  # the loader's summary names the folder
    outs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for p, w, o in zip(PROMPTS, want, outs):
        assert o["token_ids"] == w, f"TP={tp} {p!r}:\nHF:  {tok.decode(w)!r}\nrtp: {o['text']!r}"
        assert o["text"] == tok.decode(w)
