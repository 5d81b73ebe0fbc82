"""A tiny, deterministic, random-weight Qwen3 checkpoint in Hugging Face format.

Nothing can be fetched from a model hub in tests or in the default run, so rtp
builds its own checkpoint: a byte-level BPE tokenizer trained on a small
embedded English corpus, and Qwen3 weights drawn from a seeded generator. The
files are laid out exactly like a published Qwen3 checkpoint, so
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load them unchanged and serve as the
numerical reference for rtp's own model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from rtp.errors import ConfigError
from rtp.log import get_logger

logger = get_logger(__name__)

# Bump when the files written for the same spec change, so that cached default
# models built by an older rtp are not reused.
FORMAT_VERSION = 3  # 3: Qwen3's thinking and tool-call tokens, a Qwen3-style chat template

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen3's markup tokens: added tokens (one id each, never split) that are not "special" in HF's sense,
# so decoding with skip_special_tokens=True keeps them in the text, where the reasoning and tool-call
# parsers find them. Ids follow the special tokens, in this order.
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
MARKUP_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END, THINK_START, THINK_END)

# Number of BPE tokens (256 byte symbols + learned merges) before the specials.
_BPE_VOCAB_SIZE = 445

# Pre-tokenizer split used by the Qwen2/Qwen3 tokenizers. AutoTokenizer rebuilds
# this pipeline for model_type "qwen3", so tokenizer.json uses the same one and
# the raw `tokenizers` file and the HF tokenizer agree token for token.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Chat template with Qwen3's structure and tokens (written for rtp):
# - a system turn first when there is a system message or tools; tools are listed one JSON object per
#   line inside <tools></tools>, with the instruction to answer calls as <tool_call>{"name", "arguments"}</tool_call>;
# - assistant turns: earlier turns drop their reasoning; the turns after the last user query keep it as a
#   <think>...</think> block (the message's reasoning_content); tool calls follow the content, one
#   <tool_call> block each;
# - consecutive role "tool" messages become one user turn of <tool_response> blocks;
# - the generation prompt opens the assistant turn; enable_thinking=false adds an empty think block, which
#   tells Qwen3 to answer without reasoning.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages|reverse %}"
    "{%- if ns.last_query < 0 and m.role == 'user' and not (m.content is string"
    " and m.content.startswith('<tool_response>')) %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nThese functions are available; their signatures are listed inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with one JSON object per call, holding the function name and'"
    " ' its arguments, inside <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>,'"
    " ' \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (reasoning or loop.last) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Training text for the tokenizer. Plain everyday English, so that common words
# and word pieces become single tokens.
_CORPUS = """\
The morning train left the station a little after seven. Most of the people on
board were going to work in the city, and they read the news, drank coffee, or
looked out of the window at the fields, the river and the small towns passing by.
A young woman near the door was reading a book about the history of the sea.
An old man beside her told her that he had been a sailor for forty years, and
that the sea was never the same on two days. She closed the book and listened.

In the kitchen, the cook cut onions, carrots and potatoes into small pieces and
put them in a large pot with water, salt and a few leaves of fresh herbs. While
the soup was cooking, she made bread: flour, water, yeast and a pinch of salt,
mixed together, left to rise for an hour, then shaped into a round loaf and
baked in a hot oven until the crust was brown and the kitchen smelled of it.

The weather changed quickly in the afternoon. Dark clouds came over the hills,
the wind turned cold, and the first drops of rain fell on the roofs of the
houses. Children ran home from school with their coats over their heads. By the
evening the storm had passed, the sky was clear again, and the stars came out
one by one above the quiet streets of the village.

A computer program is a list of instructions that tells the machine what to do.
The program reads some input, works on it step by step, and writes an output.
Good programs are simple to read and easy to change. They are tested often, so
that when something goes wrong the problem is found early and fixed before it
reaches the people who use the program every day.

The library in the centre of the town was open every day except Sunday. People
came to borrow books, to read the papers, to study for their exams, or simply to
sit in a warm room on a cold day. The librarian knew most of the visitors by name
and always had a story to share about a new book that had just arrived.

Learning a language takes time and patience. At first the words sound strange,
and every sentence is a small puzzle. After a few months the puzzles become
easier, and one day you notice that you are thinking in the new language without
trying. The best way to learn is to listen, to speak, to read and to write a
little every day, and not to be afraid of making mistakes.

The garden behind the house was small but full of life. There were roses along
the fence, tomatoes and beans in the beds, and an apple tree in the corner that
gave more fruit than the family could eat. In the summer the bees worked from
morning until night, and in the autumn the leaves turned red and yellow and fell
softly onto the grass.

What time is it? Where are you going? How much does it cost? Why did they leave
so early? Questions like these are asked a thousand times a day, in every city
and every country, by people who want to know something about the world around
them. Numbers matter too: one, two, three, ten, twenty, one hundred, 2024, 3.14.
"""


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Shape and seed of a generated Qwen3 checkpoint (field names follow HF's Qwen3Config)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6
    num_shards: int = 1
    seed: int = 0


@dataclass(frozen=True)
class TinyQwen3MoeSpec(TinyQwen3Spec):
    """Shape and seed of a generated Qwen3-MoE checkpoint (field names follow HF's Qwen3MoeConfig).

    ``intermediate_size`` is the width of the dense layers (``mlp_only_layers``, or those
    skipped by ``decoder_sparse_step``); each expert is ``moe_intermediate_size`` wide.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """HF's rule: a MoE block unless listed in mlp_only_layers or off the sparse step."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the embedded corpus (deterministic).

    The first 256 ids are the byte symbols, then come the learned merges, then the three
    special tokens, then Qwen3's markup tokens (MARKUP_TOKENS). Any Unicode text round-trips
    because every byte has a symbol.
    """
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def _validate(spec: TinyQwen3Spec, tokenizer_size: int, dtype: torch.dtype) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "num_shards"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"TinyQwen3Spec.{name} must be a positive int, got {value!r}")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ConfigError(
            f"TinyQwen3Spec.num_attention_heads ({spec.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({spec.num_key_value_heads})"
        )
    if spec.vocab_size < tokenizer_size:
        raise ConfigError(
            f"TinyQwen3Spec.vocab_size ({spec.vocab_size}) is smaller than the tokenizer ({tokenizer_size} tokens); "
            f"use vocab_size >= {tokenizer_size}"
        )
    if isinstance(spec, TinyQwen3MoeSpec):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(spec, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"TinyQwen3MoeSpec.{name} must be a positive int, got {value!r}")
        if spec.num_experts_per_tok > spec.num_experts:
            raise ConfigError(f"TinyQwen3MoeSpec.num_experts_per_tok ({spec.num_experts_per_tok}) must be at most "
                              f"num_experts ({spec.num_experts})")
        bad = [i for i in spec.mlp_only_layers if not 0 <= i < spec.num_hidden_layers]
        if bad:
            raise ConfigError(f"TinyQwen3MoeSpec.mlp_only_layers has {bad}: layers are 0..{spec.num_hidden_layers - 1}")
    if spec.rope_scaling is not None and not isinstance(spec.rope_scaling, dict):
        raise ConfigError(f"TinyQwen3Spec.rope_scaling must be a dict or None, got {spec.rope_scaling!r}")
    num_tensors = 2 + 11 * spec.num_hidden_layers + (0 if spec.tie_word_embeddings else 1)
    if spec.num_shards > num_tensors:
        raise ConfigError(
            f"TinyQwen3Spec.num_shards ({spec.num_shards}) must be at most the number of tensors ({num_tensors})"
        )
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPE_NAMES.values())}, got {dtype}")


def _generator(seed: int, name: str) -> torch.Generator:
    # One generator per tensor, seeded from (seed, name): a tensor's values do not
    # depend on which other tensors exist (tied and untied share embed_tokens).
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32) * std


def _norm_weight(seed: int, name: str, size: int, center: float = 1.0) -> torch.Tensor:
    # Around `center` but perturbed by 10%, so a reimplementation that drops or
    # misplaces a norm weight gives visibly different logits.
    return center * (1.0 + 0.1 * torch.randn((size,), generator=_generator(seed, name), dtype=torch.float32))


def make_weights(spec: TinyQwen3Spec, used_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """All float32 tensors of the checkpoint, under HF Qwen3 names, in a fixed order.

    Rows at or past ``used_vocab`` (padding ids no tokenizer token maps to) are
    scaled down, like the untrained padding rows of real checkpoints, so greedy
    decoding rarely picks an id that decodes to nothing.

    The init is not HF's (std 0.02 everywhere): with tiny random weights a tied
    model keeps echoing one token. These scales were tuned so that greedy
    decoding wanders over many tokens, which is what comparison tests need.
    """
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    s = spec.seed
    # A small embedding keeps the current token from dominating the residual
    # stream (with tied weights that would make every token predict itself).
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(s, "embed", (spec.vocab_size, h), 0.25)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": _norm_weight(s, p + "ln1", h),
            # Rows ~ 1/sqrt(fan_in): outputs of unit scale for unit-scale inputs.
            "self_attn.q_proj.weight": _normal(s, p + "q", (q_out, h), h**-0.5),
            "self_attn.k_proj.weight": _normal(s, p + "k", (kv_out, h), h**-0.5),
            "self_attn.v_proj.weight": _normal(s, p + "v", (kv_out, h), h**-0.5),
            "self_attn.o_proj.weight": _normal(s, p + "o", (h, q_out), q_out**-0.5),
            # q/k norms around 2 sharpen attention (scores std ~4 instead of ~1),
            # so what a position attends to changes from step to step.
            "self_attn.q_norm.weight": _norm_weight(s, p + "qn", hd, 2.0),
            "self_attn.k_norm.weight": _norm_weight(s, p + "kn", hd, 2.0),
            "post_attention_layernorm.weight": _norm_weight(s, p + "ln2", h),
            "mlp.gate_proj.weight": _normal(s, p + "gate", (inter, h), h**-0.5),
            "mlp.up_proj.weight": _normal(s, p + "up", (inter, h), h**-0.5),
            # A strong MLP branch makes the next token depend on more than the last one.
            "mlp.down_proj.weight": _normal(s, p + "down", (h, inter), 4.0 * inter**-0.5),
        }
        if isinstance(spec, TinyQwen3MoeSpec) and spec.is_sparse(i):
            for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                del layer[k]
            layer |= _moe_weights(spec, p)
        weights.update({p + k: v for k, v in layer.items()})
    weights["model.norm.weight"] = _norm_weight(s, "norm", h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = _normal(s, "lm_head", (spec.vocab_size, h), 0.25)
    if used_vocab is not None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name][used_vocab:] *= 0.1  # [vocab_size - used_vocab, hidden_size]
    return weights


def _moe_weights(spec: TinyQwen3MoeSpec, p: str) -> dict[str, torch.Tensor]:
    """Router and per-expert weights of one sparse layer, under the hub names (relative to ``p``)."""
    h, mi, s = spec.hidden_size, spec.moe_intermediate_size, spec.seed
    # Router logits of std ~2: clear winners per token, yet tokens spread over the experts.
    out = {"mlp.gate.weight": _normal(s, p + "router", (spec.num_experts, h), 2.0 * h**-0.5)}
    for e in range(spec.num_experts):
        q = f"mlp.experts.{e}."
        out[q + "gate_proj.weight"] = _normal(s, p + f"e{e}.gate", (mi, h), h**-0.5)
        out[q + "up_proj.weight"] = _normal(s, p + f"e{e}.up", (mi, h), h**-0.5)
        # The routing weights sum to <= 1: a stronger down projection keeps the branch as
        # strong as the dense MLP's.
        out[q + "down_proj.weight"] = _normal(s, p + f"e{e}.down", (h, mi), 6.0 * mi**-0.5)
    return out


def _shard_names(names: list[str], sizes: dict[str, int], num_shards: int) -> list[list[str]]:
    # Contiguous groups of roughly equal bytes; every group gets at least one tensor.
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for idx, name in enumerate(names):
        shard = min(done * num_shards // total, num_shards - 1)
        # Leave at least one tensor for each later shard.
        shard = max(shard, num_shards - (len(names) - idx))
        # Never skip a shard (keeps every file non-empty).
        while shard > 0 and not groups[shard - 1]:
            shard -= 1
        groups[shard].append(name)
        done += sizes[name]
    assert all(groups), "every shard holds at least one tensor"
    return groups


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(weights)
    assert num_shards <= len(names), "checked by _validate"
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    sizes = {n: t.numel() * t.element_size() for n, t in weights.items()}
    weight_map: dict[str, str] = {}
    for k, group in enumerate(_shard_names(names, sizes, num_shards)):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in group})
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def _write_configs(out: Path, spec: TinyQwen3Spec, dtype: torch.dtype, tok: Tokenizer) -> None:
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    dtype_name = _DTYPE_NAMES[dtype]
    # Keys as in published Qwen3 config.json files (rope_theta/rope_scaling at top level).
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling is not None else None,
        "rope_theta": spec.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab_size,
    }
    if isinstance(spec, TinyQwen3MoeSpec):
        # Keys as in the published Qwen3-30B-A3B config.json (num_experts, not num_local_experts).
        config |= {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "decoder_sparse_step": spec.decoder_sparse_step,
            "mlp_only_layers": list(spec.mlp_only_layers),
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": spec.norm_topk_prob,
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot})
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        } | {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": False}
            for t in MARKUP_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tok_config)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")


def make_tiny_qwen3(
    out_dir: str | Path, spec: TinyQwen3Spec = TinyQwen3Spec(), dtype: torch.dtype = torch.float32
) -> Path:
    """Write a random-weight Qwen3 checkpoint (config, weights, tokenizer) into ``out_dir``.

    A :class:`TinyQwen3MoeSpec` gives a Qwen3-MoE checkpoint (one tensor per expert, as on the hub).

    The same spec and dtype always give byte-identical files. Returns ``out_dir``.
    """
    tok = build_tokenizer()
    tokenizer_size = tok.get_vocab_size(with_added_tokens=True)
    _validate(spec, tokenizer_size, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {n: t.to(dtype).contiguous() for n, t in make_weights(spec, tokenizer_size).items()}
    _write_weights(out, weights, spec.num_shards)
    _write_configs(out, spec, dtype, tok)
    return out


def spec_digest(spec: TinyQwen3Spec, dtype: torch.dtype = torch.float32) -> str:
    """Short hash naming the cache folder of one (spec, dtype, format version)."""
    key = {"format": FORMAT_VERSION, "dtype": _DTYPE_NAMES.get(dtype, str(dtype)), "spec": dataclasses.asdict(spec)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_model_dir(cache_root: str | Path | None = None) -> Path:
    """The random tiny Qwen3 the tests use (not rtp's default model: that is rtp.assets'), built on first use.

    The folder lives under ``cache_root``, else ``$RTP_CACHE_DIR``, else
    ``~/.cache/rtp``. Safe when several processes (torchrun ranks) call it at
    once: each builds into its own temporary sibling and renames it into place;
    a process that loses the race discards its copy and uses the winner's.
    """
    if cache_root is None:
        cache_root = os.environ.get("RTP_CACHE_DIR") or Path.home() / ".cache" / "rtp"
    root = Path(cache_root).expanduser()
    spec = TinyQwen3Spec()
    final = root / f"tiny-qwen3-{spec_digest(spec)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cached model is an ordinary folder
        logger.info("building the default tiny Qwen3 model in %s", final)
        make_tiny_qwen3(tmp, spec)
        try:
            # Atomic on POSIX: readers see either no folder or a complete one.
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("another process built %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_kv_scales(model_dir: str | Path, k_scales: list[float], v_scales: list[float], shape: tuple[int, ...] = (),
                  v_shape: tuple[int, ...] | None = None) -> Path:
    """Add per-layer FP8 KV-cache scales (``model.layers.N.self_attn.k_scale`` / ``v_scale``, float32 of ``shape``,
    ``()`` or ``(1,)`` as FP8 checkpoints store them; ``v_shape`` for the v scales, default ``shape``) to a
    single-file checkpoint written by :func:`make_tiny_qwen3`."""
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    weights = load_file(str(path))
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.full(shape, k, dtype=torch.float32)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.full(shape if v_shape is None else v_shape, v,
                                                                    dtype=torch.float32)
    save_file(weights, str(path), metadata={"format": "pt"})
    return Path(model_dir)
