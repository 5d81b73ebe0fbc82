"""Throughput of rtp vs HF transformers on the same model and workload, in one run.

    python scripts/bench.py                       # tiny default model, CPU
    python scripts/bench.py --preset small        # a larger random Qwen3 (built into a temp folder)
    python scripts/bench.py --model /models/Qwen3-0.6B --device cuda --num-prompts 256

Both engines decode greedily for exactly --max-tokens tokens per prompt (EOS
ignored), so they do the same work. HF runs batched generate() with left
padding; rtp runs rtp.generate() (TP=1, this process). Prints tokens/s of each
and the ratio; absolute numbers on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import rtp  # noqa: E402
from rtp.testing import TinyQwen3Spec, default_model_dir, make_tiny_qwen3  # noqa: E402

PRESETS = {
    "small": TinyQwen3Spec(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=64, vocab_size=2048),
}


def hf_generate(model_dir: str, prompts: list[list[int]], max_tokens: int, device: str, dtype: torch.dtype,
                batch: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF Qwen3 folder (default: the tiny model, or --preset)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="build a larger random Qwen3 instead")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32, help="HF generate() batch size")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    if args.model:
        model_dir = args.model
    elif args.preset:
        model_dir = str(make_tiny_qwen3(Path(tempfile.mkdtemp()) / args.preset, PRESETS[args.preset]))
    else:
        model_dir = str(default_model_dir())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size if args.model else 400
    prompts = [torch.randint(0, min(vocab, 400) if not args.model else vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.num_prompts)]
    total = args.num_prompts * args.max_tokens

    rtp.init(None, model=model_dir, device=args.device, dtype="auto", log_level="WARNING",
             max_num_seqs=max(args.num_prompts, 1), enforce_eager=args.device == "cpu")
    params = rtp.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rtp.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = rtp.generate(prompts, params, use_tqdm=False)
    rtp_s = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == total
    rtp.shutdown()

    hf_generate(model_dir, prompts[:2], 2, args.device, dtype, 2)  # warm-up
    hf_s = hf_generate(model_dir, prompts, args.max_tokens, args.device, dtype, args.hf_batch)

    print(f"model: {model_dir}")
    print(f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, greedy")
    print(f"rtp: {rtp_s:7.2f} s  {total / rtp_s:9.1f} tok/s")
    print(f"HF : {hf_s:7.2f} s  {total / hf_s:9.1f} tok/s  (generate, batch {args.hf_batch})")
    print(f"speed-up rtp / HF: {hf_s / rtp_s:.2f}x")


if __name__ == "__main__":
    main()
