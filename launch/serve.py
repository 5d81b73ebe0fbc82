"""OpenAI-compatible HTTP server; see rtp/entrypoints/serve.py (also: `rtp serve`).

Run under torchrun from a checkout, as documented in the README::

    torchrun --standalone --nproc-per-node 2 launch/serve.py --config configs/cpu.yaml ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rtp.cli import exit_process  # noqa: E402
from rtp.entrypoints.serve import main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
