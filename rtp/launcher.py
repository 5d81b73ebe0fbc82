"""The ``rtp`` command: ``rtp serve`` and ``rtp generate`` start torchrun for you.

    rtp serve --nproc-per-node 2 --port 8000
    rtp generate --prompts-file prompts.jsonl --output out.jsonl

Each takes the flags of ``launch/serve.py`` / ``launch/generate.py`` (``rtp serve --help``) plus
``--nproc-per-node`` (default: the config's ``tensor_parallel_size``, else 1), and runs
``torchrun --standalone --nproc-per-node N -m rtp.entrypoints.<command> ...`` through torch's own
launcher API (``torch.distributed.run``): a free rendezvous port, the ranks are children of
this process.

Exit status: 0 when every rank exits 0; 1 when a rank fails (torch logs which) or the
config is invalid; 0 after SIGTERM or Ctrl-C (SIGINT): torch's agent forwards the signal to
every rank, which shut down gracefully (the server finishes running requests within
``server.shutdown_grace_s``), and returns once all have exited (a rank still alive after
30 s is killed).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rtp.errors import RtpError

COMMANDS = {"serve": "rtp.entrypoints.serve", "generate": "rtp.entrypoints.generate"}


def _usage() -> str:
    return "usage: rtp {serve,generate} [--nproc-per-node N] [flags of the command; see rtp <command> --help]"


def default_nproc(config_path: str | None, model: str | None) -> int:
    """The config's ``tensor_parallel_size``, else 1."""
    from rtp.config import default_config_path, load_config

    config = load_config(config_path or default_config_path(), model=model)
    return config.tensor_parallel_size or 1


def torchrun_args(module: str, nproc: int, forward: list[str]) -> argparse.Namespace:
    """torchrun's own parsed arguments for ``--standalone --nproc-per-node N -m module *forward``."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", module, *forward])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage() + "\n\n" + (__doc__ or ""))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{_usage()}\nrtp: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = COMMANDS[command]
    parser = importlib.import_module(module).build_parser()
    parser.prog = f"rtp {command}"
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="number of ranks (= TP size; default: the config's tensor_parallel_size, else 1)")
    args = parser.parse_args(rest)  # bad flags fail here, before any rank starts
    # The command's own flags go to every rank unchanged; only --nproc-per-node is the launcher's.
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--nproc-per-node", type=int)
    _, forward = own.parse_known_args(rest)
    nproc = args.nproc_per_node
    try:
        if nproc is None:
            nproc = default_nproc(args.config, args.model)
        if nproc < 1:
            raise RtpError(f"--nproc-per-node must be >= 1, got {nproc}")
    except RtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(torchrun_args(module, nproc, forward))
    except SignalException as e:
        print(f"rtp {command}: stopped by {e.sigval.name}; every rank has exited", file=sys.stderr)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"rtp {command}: rank {rank} exited with code {failure.exitcode} (its messages are above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
