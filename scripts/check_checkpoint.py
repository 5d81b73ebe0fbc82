"""Load a checkpoint as one rank of a TP group would, without serving it: prints what it holds, or the error.

    python scripts/check_checkpoint.py /models/Qwen3-30B-A3B-FP8 --tp 4 --rank 3
    python scripts/check_checkpoint.py /models/Qwen3-8B-AWQ --dtype float32

Reads only that rank's slices (the memory of one rank: the dequantized weights of a quantized
checkpoint in ``--dtype``, on CPU), so a large checkpoint can be checked shard by shard. Every
check of a real start-up applies: model type and shapes against the TP size, quantization_config,
each tensor's name, full shape and dtype, missing tensors. Exit status 0 when it loads, else 1.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoConfig

from rtp.distributed.parallel import ParallelState
from rtp.errors import RtpError
from rtp.model.quant import checkpoint_format
from rtp.runtime.model_runner import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="HF checkpoint folder")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check the shapes against")
    ap.add_argument("--rank", type=int, default=0, help="which rank's slices to load")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--expert-parallel", action="store_true", help="MoE: whole experts per rank")
    args = ap.parse_args()
    if not 0 <= args.rank < args.tp:
        ap.error(f"--rank {args.rank} must be in [0, {args.tp})")
    ps = ParallelState(rank=args.rank, world_size=args.tp, local_rank=args.rank, device=torch.device("cpu"))
    try:
        _, report = load_model(args.model, ps, DTYPES[args.dtype], expert_parallel=args.expert_parallel)
        fmt = checkpoint_format(AutoConfig.from_pretrained(args.model))  # read (and checked) by load_model first
    except (RtpError, ValueError, OSError) as e:
        print(f"{args.model}: {e}", file=sys.stderr)
        return 1
    scales = f", FP8 KV-cache scales for {report.kv_scales // 2} layers" if report.kv_scales else ""
    print(f"{args.model}: OK ({fmt.name if fmt else 'float'} checkpoint{scales}), rank {args.rank} of {args.tp}: "
          f"{report.tensors} tensors, {report.bytes_read / 2**20:.1f} MiB read, {report.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
