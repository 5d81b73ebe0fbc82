"""The ``rtp`` command: ``rtp serve`` and ``rtp generate`` start torchrun for you.

    rtp serve MODEL --tensor-parallel-size 2 --dtype float32 --max-num-seqs 32 --port 8000
    rtp generate --prompts-file prompts.jsonl --output out.jsonl

Each takes the flags of ``launch/serve.py`` / ``launch/generate.py`` (``rtp serve --help``: every
config key, in vLLM's spelling where vLLM has the setting) plus ``--nproc-per-node``. The number
of ranks is ``--nproc-per-node``, else ``--tensor-parallel-size`` (else the config's
``tensor_parallel_size``, else 1) times ``--pipeline-parallel-size`` (or ``--data-parallel-size``). Every flag
and the config are checked here, before any rank starts: a bad value fails with one line naming the flag (or the
key). Then it runs
``torchrun --standalone --nproc-per-node N -m rtp.entrypoints.<command> ...`` through torch's own
launcher API (``torch.distributed.run``): a free rendezvous port, the ranks are children of
this process.

Exit status: 0 when every rank exits 0; 1 when a rank fails (torch logs which) or the
config is invalid. SIGTERM or Ctrl-C (SIGINT): torch's agent forwards the signal to every rank, which
shut down gracefully (the server finishes running requests within ``server.shutdown_grace_s``), and
returns once all have exited (a rank still alive 45 s after the grace is killed); then ``rtp serve``
exits 0 (a stopped server has done its work) and ``rtp generate`` 128 + the signal's number (130, 143:
its batch did not finish, and it wrote nothing).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import NamedTuple

from rtp.errors import RtpError

COMMANDS = {"serve": "rtp.entrypoints.serve", "generate": "rtp.entrypoints.generate"}
_TEARDOWN_S = 45  # after the grace: the cancel margin, the engine loop's stop margin (35 s in all), teardown


def _usage() -> str:
    return "usage: rtp {serve,generate} [--nproc-per-node N] [flags of the command; see rtp <command> --help]"


class Launch(NamedTuple):
    nproc: int
    """How many ranks to start."""
    shutdown_timeout_s: int
    """How long torchrun's agent waits for the ranks after forwarding a SIGTERM before killing them: the server's
    shutdown_grace_s, its margins and teardown (torch's own default, 30 s, cut a longer grace short)."""


def plan_launch(module: str, args: argparse.Namespace) -> Launch:
    """Check the command's flags and config as its ranks will (ConfigError naming the flag); the rank count and
    the shutdown timeout."""
    from rtp.config import check_combinations, checkpoint_dir
    from rtp.entrypoints.flags import ENGINE_FLAGS, SERVER_FLAGS, load_config_from_args
    from rtp.model.split import check_checkpoint_split

    flags = ENGINE_FLAGS + (SERVER_FLAGS if module == COMMANDS["serve"] else ())
    config = load_config_from_args(args, flags)
    model_dir = checkpoint_dir(config)  # a folder without a checkpoint fails here, not in every rank
    nproc, tp = args.nproc_per_node, config.parallel.tensor_parallel_size  # the flag's, else the YAML's
    given = args.parallel__tensor_parallel_size is not None
    tp_source = "--tensor-parallel-size" if given else "the config's tensor_parallel_size"
    pp, dp = config.parallel.pipeline_parallel_size, config.parallel.data_parallel_size
    check_combinations(config)  # so at most one of pp and dp is above 1
    split, split_flag = pp * dp, "--pipeline-parallel-size" if pp > 1 else "--data-parallel-size"
    if nproc is not None and tp is not None and nproc != tp * split:
        times = f" x {split_flag} {split}" if split > 1 else ""
        raise RtpError(f"--nproc-per-node {nproc} and {tp_source} {tp}{times} disagree: give one of them")
    if nproc is None:
        nproc = (tp or 1) * split
    if nproc % split:
        raise RtpError(f"--nproc-per-node {nproc} is not a multiple of {split_flag} {split}")
    local = config.parallel.data_parallel_size_local
    if local is not None and local != dp:
        raise RtpError(f"--data-parallel-size-local {local} and --data-parallel-size {dp} disagree: `rtp` starts one "
                       "node, which holds every replica (for several nodes, run torchrun --nnodes on each)")
    if dp > 1 and module == COMMANDS["serve"] and config.server.api_processes == 0:
        raise RtpError("--data-parallel-size > 1 needs API frontend processes: --api-server-count >= 1, not 0")
    if nproc < 1:
        raise RtpError(f"--nproc-per-node must be >= 1, got {nproc}")
    check_checkpoint_split(model_dir, nproc // split)  # heads the TP size does not divide: here, not ~9 s later
    serving = module == COMMANDS["serve"]
    return Launch(nproc, math.ceil(config.server.shutdown_grace_s) + _TEARDOWN_S if serving else _TEARDOWN_S)


def torchrun_args(module: str, launch: Launch, forward: list[str]) -> argparse.Namespace:
    """torchrun's own parsed arguments for ``--standalone --nproc-per-node N --shutdown-timeout S -m module
    *forward``."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(["--standalone", f"--nproc-per-node={launch.nproc}",
                                         f"--shutdown-timeout={launch.shutdown_timeout_s}", "-m", module, *forward])


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
    entry = importlib.import_module(module)
    parser = entry.build_parser()
    parser.prog = f"rtp {command}"
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="number of ranks (= TP x PP, or DP x TP; default: --tensor-parallel-size (else the "
                             "config's, else 1) x --pipeline-parallel-size or --data-parallel-size)")
    args = parser.parse_args(rest)  # bad flags fail here, before any rank starts
    if hasattr(entry, "resolve_args"):
        entry.resolve_args(parser, args)  # e.g. serve's positional MODEL
    # The command's own flags go to every rank unchanged; only --nproc-per-node is the launcher's.
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--nproc-per-node", type=int)
    _, forward = own.parse_known_args(rest)
    try:
        launch = plan_launch(module, args)
        if hasattr(entry, "check_args"):
            entry.check_args(args)  # e.g. generate's input and output files
    except RtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(torchrun_args(module, launch, forward))
    except SignalException as e:
        unfinished = "" if command == "serve" else " before the batch finished (nothing written)"
        print(f"rtp {command}: stopped by {e.sigval.name}{unfinished}; every rank has exited", file=sys.stderr)
        return 0 if command == "serve" else 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"rtp {command}: rank {rank} exited with code {failure.exitcode} (its messages are above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
