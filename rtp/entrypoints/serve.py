r"""OpenAI-compatible HTTP server: rank 0 serves HTTP, every rank runs its shard of the model.

    rtp serve --nproc-per-node 2 [--config configs/cpu.yaml] [--model DIR] [--host 127.0.0.1] [--port 8000]
    torchrun --standalone --nproc-per-node 2 launch/serve.py --config configs/cpu.yaml \
        [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--reasoning-parser qwen3]
        [--enable-auto-tool-choice --tool-call-parser hermes]

Command-line flags override the YAML's ``server:`` settings; ``--port 0``
picks a free port. Rank 0 logs ``serving on http://HOST:PORT`` once it
accepts requests. The API key may also come from the RTP_API_KEY environment
variable (it then stays out of the process list). SIGTERM or Ctrl-C stops
the server gracefully: running requests get ``server.shutdown_grace_s``
seconds to finish, then the workers are shut down and the process exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import rtp
from rtp.cli import add_common_args, fail
from rtp.config import default_config_path, load_config
from rtp.errors import RtpError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--host", help="address to listen on (overrides server.host)")
    ap.add_argument("--port", type=int, help="TCP port, 0 for a free one (overrides server.port)")
    ap.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $RTP_API_KEY, else none)")
    ap.add_argument("--served-model-name", help="model name in the API (default: the model folder's name)")
    ap.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    ap.add_argument("--reasoning-parser", choices=["qwen3"],
                    help="split <think>...</think> of chat outputs into reasoning_content (server.reasoning_parser)")
    ap.add_argument("--tool-call-parser", choices=["hermes", "qwen3"],
                    help="parse Qwen3's <tool_call> blocks into tool_calls (server.tool_call_parser)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                    help='allow tool_choice "auto", the default with tools; needs --tool-call-parser')
    return ap


def main(argv: list[str] | None = None) -> int:
    from rtp.server import bind_socket, run_server  # needs the [serve] extras

    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    server = {"host": args.host, "port": args.port, "api_key": args.api_key or os.environ.get("RTP_API_KEY") or None,
              "served_model_name": args.served_model_name, "reasoning_parser": args.reasoning_parser,
              "tool_call_parser": args.tool_call_parser, "enable_auto_tool_choice": args.enable_auto_tool_choice}
    sock = None
    try:
        config = load_config(args.config or default_config_path(), model=args.model, server=server)
        if rank == 0:
            # Claim the port before loading the model: a busy port fails in a second, not after the load.
            sock = bind_socket(config.server.host, config.server.port)
        runtime = rtp.init(config)  # worker ranks serve inside and exit there
        return run_server(runtime, sock, access_log=args.access_log)
    except RtpError as e:
        return fail(e)
    finally:
        if sock is not None:
            sock.close()
        rtp.shutdown()


if __name__ == "__main__":
    sys.exit(main())
