"""Train the EAGLE-3 head shipped in ``rtp/assets/qwen3-tiny-shakespeare-eagle3`` (plain torch, CPU, minutes).

    OMP_NUM_THREADS=2 python scripts/train_eagle3.py            # writes the shipped folder
    python scripts/train_eagle3.py --out /tmp/head --steps 50   # a quick try elsewhere

Data: the shipped model's own text. From ``<|endoftext|>`` and from short random-token prompts, rtp
generates ``SEQS`` continuations of ``SEQ_LEN`` tokens with the model, half sampled (temperature 0.8,
seeded), half greedy (1 sequence in 16 held out, to watch). One Hugging Face forward pass over each
continuation gives the hidden states entering layers (2, L/2, L-3) = (2, 2, 1) (``hidden_states[i]``)
and the target's greedy next tokens, which are the labels (a greedy verifier accepts a draft exactly
when it is that token). About 6 minutes on 2 cores; the result is about 1.6 MB (the fc projection
3H -> H alone is 0.4 MB at H = 256).

Head: SpecForge's ``LlamaForCausalLMEagle3`` layout (:mod:`rtp.spec.eagle3_head`): hidden 256 (the
target's embedding is shared, not saved), 4 query / 1 KV heads of 64, MLP 256, and a draft vocabulary of
the ``DRAFT_VOCAB`` most frequent labels (``d2t`` maps it into the target's 4096), saved in bfloat16.

Training-time test (EAGLE-3): each window is unrolled ``TTT_STEPS`` times. Step 0 reads the target's
features; step ``i`` at position ``q`` reads the head's step ``i - 1`` output at ``q - 1`` and attends
to the step-0 keys of positions ``<= q - i`` plus its own steps' keys at ``q - i + 1 .. q`` -- exactly
what the head sees at inference when it drafts its ``i + 1``-th token. The loss is the cross-entropy
of every step (weights 0.8^i) against the label, over the draft vocabulary (labels outside it are
skipped). AdamW lr 3e-3 (cosine to 3e-4, 30 warm-up steps), ``STEPS`` steps of ``BATCH`` windows,
seed 0.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "rtp" / "assets" / "qwen3-tiny-shakespeare"
OUT = ROOT / "rtp" / "assets" / "qwen3-tiny-shakespeare-eagle3"

SEED = 0
SEQS, SEQ_LEN, PROMPT_LEN = 512, 224, 16
DRAFT_VOCAB = 512
HEADS, KV_HEADS, HEAD_DIM, MLP = 4, 1, 64, 256
STEPS, BATCH, LR, WARMUP, TTT_STEPS = 800, 8, 3e-3, 30, 3
EPS = 1e-6


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class Head(nn.Module):
    """The head in SpecForge's tensor names (``midlayer.*``), dense attention with an explicit mask."""

    def __init__(self, hidden: int, vocab: int, draft_vocab: int) -> None:
        super().__init__()
        h, d = hidden, HEAD_DIM
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, HEADS * d, bias=False)
        self.k_proj = nn.Linear(2 * h, KV_HEADS * d, bias=False)
        self.v_proj = nn.Linear(2 * h, KV_HEADS * d, bias=False)
        self.o_proj = nn.Linear(HEADS * d, h, bias=False)
        self.gate_proj = nn.Linear(h, MLP, bias=False)
        self.up_proj = nn.Linear(h, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, h, bias=False)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h)) for n in
                                       ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = torch.arange(4096, dtype=torch.float32)[:, None] * inv
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: [B, heads, T, d]
        cos, sin = self.cos[pos], self.sin[pos]  # [T, d/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def step_inputs(self, emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor):  # noqa: ANN201
        """(q [B, Hq, T, d], k, v [B, Hkv, T, d], residual [B, T, H]) of one unrolled step."""
        b, t, _ = emb.shape
        g = rms(feats, self.norms["hidden_norm"])
        x = torch.cat([rms(emb, self.norms["input_layernorm"]), g], dim=-1)
        q = self.rope(self.q_proj(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2), pos)
        k = self.rope(self.k_proj(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2), pos)
        v = self.v_proj(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return q, k, v, feats

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        r = residual + self.o_proj(attn.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))
        m = rms(r, self.norms["post_attention_layernorm"])
        return r + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms(out, self.norms["norm"]))


def ttt_masks(t: int, steps: int) -> list[torch.Tensor]:
    """Per step i, the boolean mask [T, (i + 1) T] over the keys of steps 0..i (see the module docstring)."""
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    out = []
    for i in range(steps):
        parts = [k <= q - i]  # step 0 keys: real positions up to the anchor q - i
        parts += [k == q - i + j for j in range(1, i + 1)]  # step j's key at q - i + j
        out.append(torch.cat(parts, dim=1))
    return out


def unrolled_loss(head: Head, embed: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, labels: torch.Tensor,
                  masks: list[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """ids [B, T + 1] (token at p + 1 is the input at p), aux [B, T, 3H], labels [B, T] (draft ids, -1: skip)."""
    t = aux.shape[1]
    pos = torch.arange(t)
    emb = F.embedding(ids[:, 1:], embed)  # [B, T, H]
    feats = head.fc(aux)
    keys, values = [], []
    total, accs = torch.zeros(()), []
    for i in range(TTT_STEPS):
        q, k, v, res = head.step_inputs(emb, feats, pos)
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, dim=2).repeat_interleave(HEADS // KV_HEADS, 1)
        vv = torch.cat(values, dim=2).repeat_interleave(HEADS // KV_HEADS, 1)
        attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=masks[i])
        out = head.finish(attn, res)  # [B, T, H]
        logits = head.logits(out)
        lab = labels.clone()
        lab[:, :i] = -1  # positions without i earlier real positions to anchor on
        total = total + 0.8**i * F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-1)
        ok = lab >= 0
        accs.append(float((logits.argmax(-1)[ok] == lab[ok]).float().mean()))
        # The next step's feature at q is this step's output at q - 1 (position 0 gets a zero feature).
        feats = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return total, accs


def make_data(model, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(ids [N, SEQ_LEN], aux [N, SEQ_LEN - 1, 3H], greedy next token [N, SEQ_LEN - 1]) of the model's text.

    rtp generates the continuations (far faster than HF's generate here); HF's forward gives the states.
    """
    import rtp

    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 4000
    prompts = [[bos] if n % 2 == 0 else torch.randint(0, 4000, (PROMPT_LEN,), generator=gen).tolist()
               for n in range(SEQS)]
    params = [rtp.SamplingParams(temperature=0.8 if n % 4 < 2 else 0.0, seed=SEED + n, max_tokens=SEQ_LEN,
                                 ignore_eos=True) for n in range(SEQS)]
    rtp.init(None, model=str(TARGET), device="cpu", dtype="float32", log_level="WARNING",
             enable_prefix_caching=False, seed=SEED)
    outs = rtp.generate(prompts, params, use_tqdm=False)
    rtp.shutdown()
    ids = torch.tensor([o.token_ids for o in outs])  # [N, SEQ_LEN]: the continuations
    layers = model.config.num_hidden_layers
    aux_ids = (2, layers // 2, layers - 3)
    with torch.no_grad():
        res = model(ids, output_hidden_states=True)
    aux = torch.cat([res.hidden_states[i][:, :-1] for i in aux_ids], dim=-1)  # positions 0 .. T-2
    greedy = res.logits.argmax(-1)  # [N, T]: the target's next token after each position
    return ids, aux, greedy[:, 1:]  # head at p predicts the token after p + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ids, aux, greedy = make_data(model, gen)
    cfg = model.config
    print(f"data: {ids.shape[0]} sequences of {ids.shape[1]} tokens in {time.time() - start:.0f} s")
    counts = torch.bincount(greedy.flatten(), minlength=cfg.vocab_size)
    top = counts.argsort(descending=True)[:DRAFT_VOCAB].sort().values  # draft id -> target id, ascending
    print(f"draft vocabulary {DRAFT_VOCAB}: covers {counts[top].sum() / counts.sum():.1%} of the labels")
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    t2d[top] = torch.arange(DRAFT_VOCAB)
    labels = t2d[greedy]  # [N, T-1], -1 outside the draft vocabulary
    n_val = max(1, ids.shape[0] // 16)
    head = Head(cfg.hidden_size, cfg.vocab_size, DRAFT_VOCAB)
    embed = model.model.embed_tokens.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    masks = ttt_masks(aux.shape[1], TTT_STEPS)
    for step in range(args.steps):
        lr = LR * min(1.0, (step + 1) / WARMUP)
        lr = 0.1 * LR + (lr - 0.1 * LR) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(n_val, ids.shape[0], (BATCH,), generator=gen)
        loss, accs = unrolled_loss(head, embed, ids[idx], aux[idx], labels[idx], masks)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                _, val = unrolled_loss(head, embed, ids[:n_val], aux[:n_val], labels[:n_val], masks)
            print(f"step {step}: loss {loss.item():.3f}, train acc {[f'{a:.2f}' for a in accs]}, "
                  f"held-out acc {[f'{a:.2f}' for a in val]} ({time.time() - start:.0f} s)")
    save(head, top, cfg, args.out)
    print(f"saved {args.out} in {time.time() - start:.0f} s")


def save(head: Head, top: torch.Tensor, cfg, out: Path) -> None:  # noqa: ANN001
    """SpecForge's layout: config.json (LlamaForCausalLMEagle3) and model.safetensors (bfloat16, int d2t)."""
    p = "midlayer."
    t = {"fc.weight": head.fc.weight, "lm_head.weight": head.lm_head.weight, "norm.weight": head.norms["norm"]}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        t[f"{p}self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        t[f"{p}mlp.{name}.weight"] = getattr(head, name).weight
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"{p}{name}.weight"] = head.norms[name]
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in t.items()}
    tensors["d2t"] = (top - torch.arange(len(top))).long()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[top] = True
    tensors["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "intermediate_size": MLP, "hidden_act": "silu", "rms_norm_eps": EPS, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": len(top), "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": 10000.0, "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
