r"""OpenAI-compatible HTTP server: rank 0 serves HTTP, every rank runs its shard of the model.

    rtp serve [MODEL] --tensor-parallel-size 2 [--config configs/cpu.yaml] [--host 127.0.0.1] [--port 8000]
    torchrun --standalone --nproc-per-node 2 launch/serve.py --config configs/cpu.yaml \
        [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--reasoning-parser qwen3]
        [--enable-auto-tool-choice --tool-call-parser hermes]

Every config key is a flag too, spelled as vLLM spells it (``--max-num-seqs``,
``--dtype``, ``--no-enable-prefix-caching``, ...; see rtp/entrypoints/flags.py);
flags override the YAML. ``--port 0`` picks a free port. Rank 0 logs ``serving on http://HOST:PORT`` once it
accepts requests. The API key may also come from the RTP_API_KEY environment
variable (it then stays out of the process list). SIGTERM or Ctrl-C stops
the server gracefully: running requests get ``server.shutdown_grace_s``
seconds to finish, then the workers are shut down and the process exits 0.
"""

from __future__ import annotations

import argparse
import os

import rtp
from rtp.cli import add_common_args, exit_process, fail
from rtp.entrypoints.flags import (
    ENGINE_FLAGS,
    SERVER_FLAGS,
    OneLineParser,
    add_flags,
    add_model_argument,
    api_key_from_env,
    load_config_from_args,
    resolve_model_argument,
)
from rtp.errors import RtpError


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(ap)
    add_common_args(ap)
    add_flags(ap, ENGINE_FLAGS + SERVER_FLAGS)
    ap.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    return ap


def resolve_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """After parsing: the positional MODEL merged into --model, --api-key from $RTP_API_KEY."""
    resolve_model_argument(ap, args)
    api_key_from_env(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    resolve_args(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    from rtp.server import bind_socket, run_server  # needs the [serve] extras

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    sock = None
    try:
        config = load_config_from_args(args, ENGINE_FLAGS + SERVER_FLAGS)
        if rank == 0:
            # Claim the port before loading the model: a busy port fails in a second, not after the load.
            sock = bind_socket(config.server.host, config.server.port)
        runtime = rtp._init(config, {})  # worker ranks serve inside and exit there; every replica serves here
        return run_server(runtime, sock, access_log=args.access_log)
    except RtpError as e:
        return fail(e)
    finally:
        if sock is not None:
            sock.close()
        rtp.shutdown()


if __name__ == "__main__":
    exit_process(main())
