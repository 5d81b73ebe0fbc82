"""Serving benchmark: rtp's OpenAI server and, when given, vLLM's, on the same model, one at a time.

    python scripts/bench_serve.py                                   # rtp TP=1, rtp's own load generator
    python scripts/bench_serve.py --tp 1,2 --vllm-python VLLM_VENV/bin/python
    python scripts/bench_serve.py --vllm-python VLLM_VENV/bin/python --client vllm --request-rate 8

Each server is started, warmed up with a few requests, measured, and stopped before the next one
starts. The client is vLLM's serving benchmark (``vllm bench serve``'s code, random dataset, streaming,
EOS ignored; it runs from ``--vllm-python``'s venv) with ``--client vllm``, else rtp's own load
generator below (the same workload: random token-id prompts of ``--input-len``, after a ``--prefix-len``
prefix they all share (0 by default; a system prompt, served from the prefix cache), ``--output-len``
tokens, EOS ignored, streamed, requests sent at ``--request-rate`` per second, Poisson, or all at
once with ``inf``). Both clients send ``--temperature`` (default 1.0, the OpenAI API's default: sampled;
0 for greedy). Printed per server: output tok/s, mean and median TTFT (the first chunk with a choice, even one
whose text is held back), mean TPOT (per request: (last token - first token) / (tokens - 1)), failed requests,
and the ratios rtp / vLLM.

vLLM's server is ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_CPU_KVCACHE_SPACE``
(GiB, ``--kv-gib``; rtp gets a cache of the same size, split over its ranks) and
``VLLM_CPU_OMP_THREADS_BIND`` set to this process's allowed cores; both servers run in float32 unless
``--dtype`` says otherwise. The machine should be quiet:
compare the ratios of one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    """What one benchmark run measured."""

    engine: str
    output_tok_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    completed: int
    failed: int
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- servers


def allowed_cores() -> str:
    """This process's CPU affinity as ranges like "0-1,4" (VLLM_CPU_OMP_THREADS_BIND's format)."""
    ranges: list[list[int]] = []
    for core in sorted(os.sched_getaffinity(0)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in its own process group; ``stop()`` sends SIGTERM, then SIGKILL after a grace."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log}\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not answer within {timeout_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def start_rtp(model: str, tp: int, dtype: str, port: int, log: Path, extra: list[str], kv_gib: float,
              api_processes: int | None = None) -> ServerProcess:
    """rtp's server with a KV cache of ``kv_gib`` in all (``kv_gib / tp`` per rank); ``api_processes`` HTTP
    frontend processes (None: rtp's default for the core count), each of which gets one core the ranks'
    threads leave free."""
    cmd = [sys.executable, "-m", "rtp.launcher", "serve", model, "--tensor-parallel-size", str(tp), "--dtype", dtype,
           "--port", str(port), "--log-level", "WARNING", "--cpu-kv-cache-gib", str(kv_gib / tp), *extra]
    if api_processes is not None:
        cmd += ["--api-server-count", str(api_processes)]
    cores = len(os.sched_getaffinity(0)) - (api_processes or 0)
    threads = max(1, cores // tp)
    frontends = "rtp's default number of" if api_processes is None else api_processes
    print(f"rtp TP={tp}: {threads} compute thread(s) per rank, {frontends} API frontend process(es)", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return ServerProcess(f"rtp TP={tp}", cmd, env, log)


def start_vllm(python: str, model: str, dtype: str, port: int, kv_gib: int, log: Path,
               extra: list[str]) -> ServerProcess:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
           "--port", str(port), "--host", "127.0.0.1", "--served-model-name", Path(model).name, *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND=allowed_cores())
    return ServerProcess("vLLM", cmd, env, log)


# ---------------------------------------------------------------------------- clients


# `vllm bench serve` itself, without the CLI wrapper (which looks up a "vllm" distribution; the CPU
# build is installed as "vllm-cpu").
_VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def run_vllm_client(python: str, base_url: str, model: str, served: str, args: argparse.Namespace,
                    out_dir: Path, label: str) -> Result:
    """``vllm bench serve`` against ``base_url``; its saved JSON result read back."""
    name = f"{re.sub(r'[^A-Za-z0-9]+', '_', label)}.json"
    api = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"] if args.chat else [
        "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd = [python, "-c", _VLLM_BENCH, *api, "--base-url", base_url, "--model", served, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-prefix-len", str(args.prefix_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--temperature", str(args.temperature), "--ignore-eos",
           "--seed", str(args.seed),
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm",
           "--save-detailed"]
    proc = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, timeout=args.client_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    data = json.loads((out_dir / name).read_text())
    return Result(label, data["output_throughput"], data["mean_ttft_ms"], data["median_ttft_ms"], data["mean_tpot_ms"],
                  data["completed"], data.get("failed", args.num_prompts - data["completed"]))


async def _sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The response's lines, cut at newlines only (SSE's line ends): httpx's ``aiter_lines`` also cuts at
    U+0085, U+2028 and U+2029 (str.splitlines), which a server may send raw inside an event's JSON."""
    pending = ""
    async for text in r.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def _one_request(client: httpx.AsyncClient, served: str, prompt: list[int], output_len: int,
                       temperature: float, stats: dict[str, list]) -> None:
    body = {"model": served, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats["errors"].append(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            async for line in _sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    stats["errors"].append(str(event["error"])[:200])
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):  # a token, its text maybe held back (as vllm bench serve counts)
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
    except httpx.HTTPError as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")
        return
    if first is None or tokens == 0:
        stats["errors"].append("no tokens")
        return
    stats["ttft"].append(first - start)
    if tokens > 1 and last is not None:
        stats["tpot"].append((last - first) / (tokens - 1))
    stats["tokens"].append(tokens)


async def _load(base_url: str, served: str, prompts: list[list[int]], output_len: int, rate: float,
                seed: int, temperature: float) -> tuple[dict[str, list], float]:
    stats: dict[str, list] = {"ttft": [], "tpot": [], "tokens": [], "errors": []}
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(_one_request(client, served, prompt, output_len, temperature,
                                                            stats)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return stats, time.perf_counter() - start


def _mean_ms(xs: list[float]) -> float:
    return statistics.fmean(xs) * 1000 if xs else float("nan")


def random_prompts(vocab: int, n: int, length: int, seed: int, prefix_len: int = 0) -> list[list[int]]:
    """``n`` prompts of ``prefix_len`` tokens every one shares, then ``length`` random ones of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def run_rtp_client(base_url: str, served: str, vocab: int, args: argparse.Namespace, label: str) -> Result:
    prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed, args.prefix_len)
    stats, elapsed = asyncio.run(_load(base_url, served, prompts, args.output_len, args.request_rate, args.seed,
                                       args.temperature))
    median_ttft = statistics.median(stats["ttft"]) * 1000 if stats["ttft"] else float("nan")
    return Result(label, sum(stats["tokens"]) / elapsed, _mean_ms(stats["ttft"]), median_ttft, _mean_ms(stats["tpot"]),
                  len(stats["tokens"]), len(stats["errors"]), {"errors": stats["errors"][:5]})


def warm_up(base_url: str, served: str, vocab: int, args: argparse.Namespace) -> None:
    """A few short requests, so that kernel builds, first compiles and allocator growth are not measured."""
    prompts = random_prompts(vocab, 4, args.input_len, args.seed + 1)
    asyncio.run(_load(base_url, served, prompts, 8, float("inf"), args.seed, args.temperature))


# ---------------------------------------------------------------------------- driver


def vocab_size(model: str) -> int:
    """Token ids safe to send: the tokenizer's regular tokens (none of the added/special ones)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok.vocab_size


def bench_one(name: str, server: ServerProcess, base_url: str, model: str, served: str, vocab: int,
              args: argparse.Namespace, out_dir: Path) -> Result:
    try:
        server.wait_ready(base_url, args.start_timeout)
        warm_up(base_url, served, vocab, args)
        if args.client == "vllm":
            return run_vllm_client(args.vllm_python, base_url, model, served, args, out_dir, name)
        return run_rtp_client(base_url, served, vocab, args, name)
    finally:
        server.stop()


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    client = "vllm bench serve" if args.client == "vllm" else "rtp load generator"
    shared = f"a shared prefix of {args.prefix_len} + " if args.prefix_len else ""
    endpoint = "/v1/chat/completions" if args.chat else "/v1/completions"
    print(f"\n{endpoint}, {args.num_prompts} prompts, {shared}{args.input_len} in / {args.output_len} out tokens, "
          f"request rate {args.request_rate}, temperature {args.temperature}, client: {client}")
    print(f"{'server':<14} {'output tok/s':>12} {'mean TTFT ms':>13} {'median TTFT':>12} {'mean TPOT ms':>13} "
          f"{'done':>6} {'failed':>7}")
    for r in results:
        print(f"{r.engine:<14} {r.output_tok_s:>12.1f} {r.mean_ttft_ms:>13.1f} {r.median_ttft_ms:>12.1f} "
              f"{r.mean_tpot_ms:>13.2f} {r.completed:>6} {r.failed:>7}")
        for e in r.extra.get("errors", []):
            print(f"    error: {e}")
    peer = next((r for r in results if r.engine == "vLLM"), None)
    if peer is None:
        return
    for r in results:
        if r is peer:
            continue
        print(f"{r.engine} / vLLM: output tok/s {r.output_tok_s / peer.output_tok_s:.2f}x, "
              f"mean TTFT {r.mean_ttft_ms / peer.mean_ttft_ms:.2f}x, "
              f"mean TPOT {r.mean_tpot_ms / peer.mean_tpot_ms:.2f}x "
              "(tok/s: higher is better; TTFT, TPOT: lower is better)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: the model rtp ships)")
    ap.add_argument("--tp", default="1", help="comma-separated rtp TP sizes, e.g. 1,2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vllm-python", help="python of a venv with vLLM: also benchmark vLLM's server")
    ap.add_argument("--client", choices=("rtp", "vllm"), default=None,
                    help="load generator (default: vllm with --vllm-python, else rtp)")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="tokens every prompt starts with (before its --input-len own ones): prefix caching at work")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: at once)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="every request's temperature (default 1.0, the OpenAI API's; 0: greedy)")
    ap.add_argument("--chat", action="store_true",
                    help="/v1/chat/completions (each prompt one user message, the chat template applied; "
                         "--client vllm only) instead of /v1/completions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", "--vllm-kv-gib", dest="kv_gib", type=int, default=2,
                    help="KV cache of each server in GiB: vLLM's VLLM_CPU_KVCACHE_SPACE, rtp's cpu_kv_cache_gib x TP")
    ap.add_argument("--rtp-arg", action="append", default=[], help="extra flag for rtp serve (repeatable)")
    ap.add_argument("--api-server-count", type=int, default=None,
                    help="rtp's HTTP frontend processes (0: HTTP in rank 0's process; default: rtp's choice)")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra flag for vLLM's server (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--client-timeout", type=float, default=3600.0, help="seconds one client run may take")
    ap.add_argument("--skip-rtp", action="store_true", help="only vLLM's server (with --vllm-python)")
    args = ap.parse_args()
    if args.client is None:
        args.client = "vllm" if args.vllm_python else "rtp"
    if args.client == "vllm" and not args.vllm_python:
        ap.error("--client vllm needs --vllm-python")
    if args.chat and args.client != "vllm":
        ap.error("--chat needs --client vllm (rtp's load generator sends token-id prompts to /v1/completions)")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        ap.error("--num-prompts, --input-len and --output-len must be >= 1")
    if args.model is None:
        from rtp.assets import trained_model_dir

        args.model = str(trained_model_dir())
    model, served = str(Path(args.model).resolve()), Path(args.model).resolve().name
    vocab = vocab_size(model)
    out_dir = Path(tempfile.mkdtemp(prefix="rtp-bench-serve-"))
    print(f"model {model}; logs and results in {out_dir}", flush=True)
    results = []
    if not args.skip_rtp:
        for tp in (int(t) for t in args.tp.split(",")):
            port = free_port()
            server = start_rtp(model, tp, args.dtype, port, out_dir / f"rtp_tp{tp}.log", args.rtp_arg, args.kv_gib,
                               args.api_server_count)
            results.append(bench_one(f"rtp TP={tp}", server, f"http://127.0.0.1:{port}", model, served, vocab,
                                     args, out_dir))
            print(f"{results[-1]}", flush=True)
    if args.vllm_python:
        port = free_port()
        server = start_vllm(args.vllm_python, model, args.dtype, port, args.kv_gib, out_dir / "vllm.log",
                            args.vllm_arg)
        results.append(bench_one("vLLM", server, f"http://127.0.0.1:{port}", model, served, vocab, args, out_dir))
        print(f"{results[-1]}", flush=True)
    print_table(results, args)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
