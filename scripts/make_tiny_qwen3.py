"""Write a tiny random-weight Qwen3 checkpoint (HF format) and print its folder.

    python scripts/make_tiny_qwen3.py /tmp/tiny                 # default spec
    python scripts/make_tiny_qwen3.py /tmp/tiny2 --num-shards 2 --no-tie --seed 3
    python scripts/make_tiny_qwen3.py --default                 # the cached default model
    python scripts/make_tiny_qwen3.py /tmp/tiny-moe --moe       # a tiny Qwen3-MoE (8 experts, top-2)
    python scripts/make_tiny_qwen3.py /tmp/moe2 --moe --num-experts 16 --num-experts-per-tok 4 --mlp-only-layers 0

A tiny MoE runs like any checkpoint: ``scripts/demo.sh --model /tmp/tiny-moe``, or
``launch/serve.py --model /tmp/tiny-moe``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from rtp.log import setup_logging
from rtp.testing import TinyQwen3MoeSpec, TinyQwen3Spec, default_model_dir, make_tiny_qwen3

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    defaults = TinyQwen3MoeSpec()  # a superset of TinyQwen3Spec's fields, with the same dense defaults
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", help="folder to write (created if missing)")
    parser.add_argument("--default", action="store_true",
                        help="build (or find) the cached default model instead of writing out_dir")
    parser.add_argument("--cache-root", help="cache folder for --default (default: $RTP_CACHE_DIR or ~/.cache/rtp)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    for field in dataclasses.fields(TinyQwen3MoeSpec):
        if field.type in ("int", "float"):
            parser.add_argument("--" + field.name.replace("_", "-"), type=int if field.type == "int" else float,
                                default=getattr(defaults, field.name))
    parser.add_argument("--rope-scaling", type=json.loads, default=None,
                        help='JSON object, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    parser.add_argument("--no-tie", action="store_true", help="write a separate lm_head.weight")
    parser.add_argument("--moe", action="store_true", help="write a Qwen3-MoE checkpoint (the MoE options apply)")
    parser.add_argument("--mlp-only-layers", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=(),
                        help="MoE: comma-separated layers with a dense MLP instead of experts")
    parser.add_argument("--no-norm-topk-prob", action="store_true", help="MoE: do not renormalise the top-k weights")
    args = parser.parse_args(argv)
    setup_logging()

    if args.default:
        print(default_model_dir(args.cache_root))
        return
    if args.out_dir is None:
        parser.error("give out_dir or --default")
    cls = TinyQwen3MoeSpec if args.moe else TinyQwen3Spec
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.type in ("int", "float") and hasattr(args, f.name)}
    values["rope_scaling"] = args.rope_scaling
    if args.moe:
        values |= {"mlp_only_layers": args.mlp_only_layers, "norm_topk_prob": not args.no_norm_topk_prob}
    spec = cls(**values, tie_word_embeddings=not args.no_tie)
    print(make_tiny_qwen3(args.out_dir, spec, _DTYPES[args.dtype]))


if __name__ == "__main__":
    main()
