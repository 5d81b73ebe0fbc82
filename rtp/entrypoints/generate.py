r"""Offline batch generation: JSONL prompts in, JSONL completions out.

    rtp generate --nproc-per-node 2 [--config configs/cpu.yaml] --prompts-file prompts.jsonl --output out.jsonl
    torchrun --standalone --nproc-per-node 2 launch/generate.py --config configs/cpu.yaml \
        --prompts-file prompts.jsonl --output out.jsonl

Each input line is {"prompt": "..."} or {"prompt_token_ids": [...]}, plus any
SamplingParams field (temperature, max_tokens, stop, seed, ...). Without
--prompts-file a few built-in prompts are generated and printed. Every config
key is a flag too (``--max-num-seqs``, ``--dtype``, ...; rtp/entrypoints/flags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import rtp
from rtp.cli import add_common_args, exit_process, fail
from rtp.entrypoints.flags import ENGINE_FLAGS, OneLineParser, add_flags, load_config_from_args
from rtp.errors import RequestError, RtpError
from rtp.outputs import CompletionOutput, RequestOutput

# Openings from the default model's corpus (Shakespeare's plays) and one line it never saw.
DEMO_PROMPTS = ["If music be the food of love,", "Friends, Romans, countrymen,", "Now is the winter of our discontent",
                "The quick brown fox"]
PARAM_FIELDS = {f.name for f in dataclasses.fields(rtp.SamplingParams) if f.init} - {"constraint"}  # JSON fields
# The demo prints each prompt's greedy continuation and a seeded sample beside it: greedy decoding of the
# small shipped model loops ("The king of the king"), a sample reads more like a play.
DEMO_TEMPERATURE, DEMO_TOP_P, DEMO_SEED, DEMO_MAX_TOKENS = 0.8, 0.95, 0, 32


def read_requests(path: str, max_tokens: int | None = None) -> tuple[list, list[dict[str, Any]], list[int]]:
    """Parse the JSONL file into prompts, their SamplingParams fields (checked) and their line numbers; a line
    without max_tokens gets ``max_tokens`` (--max-tokens) when it is given.

    Raises RtpError naming the line of the first bad entry.
    """
    prompts, params, linenos = [], [], []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except (OSError, UnicodeDecodeError) as e:
        raise RtpError(f"{path}: cannot read the prompts file: {getattr(e, 'strerror', None) or e}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("expected a JSON object")
            if ("prompt" in item) == ("prompt_token_ids" in item):
                raise ValueError('give exactly one of "prompt" or "prompt_token_ids"')
            key = "prompt" if "prompt" in item else "prompt_token_ids"
            prompt = item.pop(key)
            if key == "prompt" and not (isinstance(prompt, str) and prompt):
                raise ValueError('"prompt" must be a non-empty string')
            if key == "prompt_token_ids" and not (
                isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
            ):
                raise ValueError('"prompt_token_ids" must be a non-empty list of integers')
            unknown = set(item) - PARAM_FIELDS
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}; allowed: {sorted(PARAM_FIELDS)}")
            if isinstance(item.get("logit_bias"), dict):  # JSON keys are strings: token ids written as such
                item["logit_bias"] = {int(k) if isinstance(k, str) and k.isdecimal() else k: v
                                      for k, v in item["logit_bias"].items()}
            if max_tokens is not None:
                item = {"max_tokens": max_tokens, **item}
            # Checked now, built after init with the model's defaults filling the rest: until then a max_tokens
            # left out is not known (rtp's 16, or the checkpoint's max_new_tokens), so it is not checked against.
            rtp.SamplingParams(**{"max_tokens": None, **item})
            params.append(item)
            prompts.append(prompt)
            linenos.append(lineno)
        except (ValueError, TypeError) as e:
            raise RtpError(f"{path}:{lineno}: {e}") from None
    return prompts, params, linenos


def check_output(path: str) -> None:
    """Refuse an ``--output`` the completions could not be written to, before any work (RtpError)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise RtpError(f"--output {path} is a directory: give a file name")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise RtpError(f"--output {path}: cannot write a file into {folder}")


def check_args(args: argparse.Namespace) -> None:
    """What ``rtp generate`` checks before it starts the ranks: the prompts file reads, --max-tokens is valid, the
    output can be written."""
    if args.max_tokens is not None:
        rtp.SamplingParams(max_tokens=args.max_tokens)  # RequestError naming max_tokens
    if args.prompts_file:
        read_requests(args.prompts_file, args.max_tokens)
    if args.output:
        check_output(args.output)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    add_flags(ap, ENGINE_FLAGS)
    ap.add_argument("--prompts-file", help="JSONL input")
    ap.add_argument("--output", help="JSONL output (default: print)")
    ap.add_argument("--max-tokens", type=int,
                    help=f"max_tokens of the built-in demo prompts (default {DEMO_MAX_TOKENS}) and of the "
                         "--prompts-file lines that give none")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        items: list[dict] | None = None
        if args.output and int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes it (other nodes may lack it)
            check_output(args.output)
        if args.prompts_file:
            prompts, items, linenos = read_requests(args.prompts_file, args.max_tokens)
        else:
            prompts, linenos = DEMO_PROMPTS + DEMO_PROMPTS, []
            max_tokens = DEMO_MAX_TOKENS if args.max_tokens is None else args.max_tokens
            params = ([rtp.SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(DEMO_PROMPTS)
                      + [rtp.SamplingParams(max_tokens=max_tokens, temperature=DEMO_TEMPERATURE, top_p=DEMO_TOP_P,
                                           seed=DEMO_SEED)] * len(DEMO_PROMPTS))
        rtp.init(load_config_from_args(args, ENGINE_FLAGS))  # worker ranks serve inside init() and exit there
        if items is not None:
            params = []
            for item, lineno in zip(items, linenos):
                try:  # the model's defaults now fill the fields the line left out: checked together
                    params.append(rtp.default_sampling_params(**item))
                except RequestError as e:
                    raise RequestError(f"{args.prompts_file}:{lineno}: {e}") from None
        try:
            outputs = rtp.generate(prompts, params)
        except RequestError as e:  # "prompt <i>: why" -> "<file>:<line>: why"
            index, _, why = str(e).partition(": ")
            if linenos and index.startswith("prompt "):
                raise RequestError(f"{args.prompts_file}:{linenos[int(index[7:])]}: {why}") from None
            raise
    except RtpError as e:
        return fail(e)
    except KeyboardInterrupt:  # every rank, during start-up: one line per node, as fail()'s
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print("rtp generate: interrupted", file=sys.stderr)
        return 130
    finally:
        rtp.shutdown()
    if args.output:
        lines = [json.dumps(_output_line(o)) for o in outputs]
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
        except OSError as e:
            return fail(RtpError(f"--output {args.output}: {e.strerror or e}"))
    try:
        _print_outputs(args, prompts, outputs)
    except BrokenPipeError:  # `rtp generate ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
    except OSError as e:
        return fail(RtpError(f"stdout: {e.strerror or e}"))
    return 0


def _print_outputs(args: argparse.Namespace, prompts: list, outputs: list[RequestOutput]) -> None:
    if args.output:
        print(f"wrote {len(outputs)} completions to {args.output}", flush=True)
    elif not args.prompts_file:
        settings = f"temperature {DEMO_TEMPERATURE}, top_p {DEMO_TOP_P}, seed {DEMO_SEED}"
        half = len(DEMO_PROMPTS)
        for prompt, greedy, sampled in zip(DEMO_PROMPTS, outputs[:half], outputs[half:]):
            print(f"{prompt!r}\n  greedy:  {greedy.text!r} ({greedy.finish_reason})\n"
                  f"  sampled: {sampled.text!r} ({sampled.finish_reason}; {settings})")
    else:
        for prompt, o in zip(prompts, outputs):
            print(f"{prompt!r} -> {o.text!r} ({o.finish_reason})")
    sys.stdout.flush()  # a closed pipe or a full disk is seen here, not at exit


def _output_line(o: RequestOutput) -> dict:
    """One JSONL line: sample 0 in the flat fields, every sample under "outputs" when n > 1."""
    def sample(c: RequestOutput | CompletionOutput) -> dict:
        return {"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"logprobs": c.logprobs, "cumulative_logprob": c.cumulative_logprob} if c.logprobs is not None
                   else {})}

    line = sample(o)
    if o.samples is not None:
        line["outputs"] = [{"index": c.index, **sample(c)} for c in o.samples]
    if o.prompt_logprobs is not None:
        line["prompt_logprobs"] = o.prompt_logprobs
    return line


if __name__ == "__main__":
    exit_process(main())
