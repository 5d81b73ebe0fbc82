"""Cut a draft model from a Qwen3 checkpoint: its first N decoder layers with the embeddings, the final
norm and the LM head (an early-exit draft: the target's tokenizer and vocabulary by construction).

    python scripts/make_layer_draft.py rtp/assets/qwen3-tiny-shakespeare /tmp/shakespeare-1layer --layers 1
    python scripts/bench.py --model rtp/assets/qwen3-tiny-shakespeare --num-requests 1 --output-len 160 --no-hf \\
        --speculative-config '{"method": "draft_model", "model": "/tmp/shakespeare-1layer",
        "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def cut_layers(src: Path, dst: Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` layers of the checkpoint in ``src`` to ``dst`` (one safetensors file)."""
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers {num_layers}: the checkpoint has {config['num_hidden_layers']} layers")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer and generation config, unchanged
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the target checkpoint folder")
    ap.add_argument("dst", type=Path, help="the draft folder to write")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers to keep (the first ones)")
    args = ap.parse_args()
    print(cut_layers(args.src, args.dst, args.layers))


if __name__ == "__main__":
    main()
