"""Soak a server with abort storms and print every rank's RSS after each storm.

    python scripts/soak.py                       # starts a TP=2 server of the tiny test model itself
    python scripts/soak.py --storms 12 --tp 2 --model DIR
    python scripts/soak.py --api-processes 2     # two HTTP frontend processes (default: the server's, 1)
    python scripts/soak.py --base-url http://127.0.0.1:8000 --pids 1234,1235   # a running server

One storm: ``--clients`` concurrent clients send ``--requests`` streaming requests
(completions and chat in turn, sampled, EOS ignored); each client drops its
connection after 0 to ``--max-chunks`` chunks, and every ``--timeout-every``-th
request gives up after a short client timeout instead. After each storm the
script waits until the server's running and waiting gauges are 0, samples
every rank's and every frontend process's RSS (``VmRSS`` of ``/proc/PID/status``) and checks that a greedy
completion still equals the one before the first storm. The first storm is a
warm-up (allocator pools, caches and compiled kernels fill up); the verdict
looks at the growth over the last ``--window`` storms.

Exit status 1 when a storm lost a request (a 5xx, an error event), a gauge
stayed above 0, greedy output changed or, with ``--max-growth-mb``, a process grew
more than that over the window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
GREEDY_PROMPT = "The quick brown fox"
CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # see rtp/runtime/onednn_caches.py


@dataclass
class StormResult:
    """What one storm saw: requests sent, dropped by the client, and anything lost on the server's side."""

    sent: int = 0
    dropped: int = 0
    timed_out: int = 0
    finished: int = 0
    failures: list[str] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (1e6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rank_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the ranks a torchrun agent started (its children with RANK in their environment)."""
    pids: dict[int, int] = {}
    for pid in _children(agent_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = pid
    return pids


def server_pids(agent_pid: int) -> dict[str, int]:
    """"rank R" and "frontend I" -> pid: the ranks a torchrun agent started and rank 0's HTTP frontend processes."""
    ranks = rank_pids(agent_pid)
    pids = {f"rank {r}": pid for r, pid in sorted(ranks.items())}
    for pid in _children(ranks[0]) if 0 in ranks else []:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rtp.server.frontend" in argv and b"--index" in argv:
            pids[f"frontend {int(argv[argv.index(b'--index') + 1])}"] = pid
    return pids


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _body(i: int, model: str, rng: random.Random) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": rng.randint(8, 64), "temperature": 0.8, "seed": i,
              "ignore_eos": True, "stream": True}
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Storm request {i}."}], **common}
    return "/v1/completions", {"prompt": f"Storm request {i}: " + "once upon a time " * rng.randint(1, 12),
                               **common}


async def _one(client: httpx.AsyncClient, i: int, model: str, rng: random.Random, max_chunks: int,
               timeout_s: float | None, res: StormResult) -> None:
    path, body = _body(i, model, rng)
    keep = rng.randint(0, max_chunks)
    res.sent += 1
    try:
        timeout = httpx.Timeout(60.0, read=timeout_s) if timeout_s is not None else None
        async with client.stream("POST", path, json=body, **({"timeout": timeout} if timeout else {})) as r:
            if r.status_code != 200:
                await r.aread()
                res.failures.append(f"request {i}: HTTP {r.status_code}: {r.text[:200]}")
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.finished += 1
                    return
                if '"error"' in data and "error" in json.loads(data):
                    res.failures.append(f"request {i}: error event {data[:200]}")
                    return
                chunks += 1
                if timeout_s is None and chunks >= keep:
                    res.dropped += 1
                    return  # leaving the block closes the connection mid-stream: the server must abort
            res.failures.append(f"request {i}: the stream ended without [DONE]")
    except httpx.TimeoutException:
        res.timed_out += 1


async def storm(base_url: str, requests: int, clients: int, max_chunks: int, timeout_every: int, seed: int,
                headers: dict[str, str] | None = None) -> StormResult:
    """One abort storm (see the module docstring)."""
    rng = random.Random(seed)
    res = StormResult()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=120.0, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(seed * 100_000 + i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                timeout = rng.uniform(0.02, 0.3) if timeout_every and i % timeout_every == 0 else None
                await _one(client, i, model, rng, max_chunks, timeout, res)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return res


def gauges(base_url: str, headers: dict[str, str] | None = None) -> tuple[float, float]:
    """(running, waiting) requests from /metrics."""
    text = httpx.get(base_url + "/metrics", headers=headers or {}, timeout=30).text
    values = {}
    for name in ("rtp_requests_running", "rtp_requests_waiting"):
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        values[name] = float(m.group(1)) if m else float("nan")
    return values["rtp_requests_running"], values["rtp_requests_waiting"]


def wait_idle(base_url: str, timeout_s: float = 60.0, headers: dict[str, str] | None = None) -> bool:
    """Wait until both gauges are 0 (aborted requests leave the engine at its next steps)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gauges(base_url, headers) == (0.0, 0.0):
            return True
        time.sleep(0.2)
    return False


def greedy(base_url: str, headers: dict[str, str] | None = None) -> str:
    r = httpx.post(base_url + "/v1/completions", headers=headers or {}, timeout=120,
                   json={"prompt": GREEDY_PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def soak(base_url: str, pids: dict[str, int], storms: int, requests: int, clients: int, max_chunks: int,
         timeout_every: int, echo: bool = True) -> tuple[list[dict[str, float]], list[str]]:
    """Run ``storms`` storms; return each process's RSS (MB, by label: "rank 0", "frontend 0") before the first
    and after every storm, and failures."""
    failures: list[str] = []
    reference = greedy(base_url)
    curve = [{name: rss_mb(pid) for name, pid in pids.items()}]
    if echo:
        print(f"before: {_row(curve[0])}", flush=True)
    for s in range(storms):
        start = time.monotonic()
        res = asyncio.run(storm(base_url, requests, clients, max_chunks, timeout_every, seed=s + 1))
        failures += [f"storm {s}: {f}" for f in res.failures]
        if not wait_idle(base_url):
            failures.append(f"storm {s}: running/waiting gauges are {gauges(base_url)}, not 0")
        if greedy(base_url) != reference:
            failures.append(f"storm {s}: the greedy output changed")
        curve.append({name: rss_mb(pid) for name, pid in pids.items()})
        if echo:
            print(f"storm {s}{' (warm-up)' if s == 0 else ''}: {res.sent} sent, {res.dropped} dropped, "
                  f"{res.timed_out} timed out, {res.finished} finished in {time.monotonic() - start:.1f} s; "
                  f"{_row(curve[-1])}", flush=True)
    return curve, failures


def _row(rss: dict[str, float]) -> str:
    return ", ".join(f"{name} {mb:.1f} MB" for name, mb in rss.items())


def growth(curve: list[dict[str, float]], window: int) -> dict[str, float]:
    """Per process: RSS after the last storm minus RSS ``window`` storms earlier, in MB."""
    last, base = curve[-1], curve[max(0, len(curve) - 1 - window)]
    return {name: last[name] - base[name] for name in last}


def start_server(tp: int, model: str | None, config_text: str, log: Path) -> tuple[subprocess.Popen, str]:
    """launch/serve.py under torchrun on a free port; (process, base URL) once it serves."""
    from rtp.testing import default_model_dir

    cfg = log.with_suffix(".yaml")
    cfg.write_text(f"model: {model or default_model_dir()}\n{config_text}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "launch/serve.py", "--config", str(cfg), "--port", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"serving on (http://\S+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")


SERVER_CONFIG = ("device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 64\nmax_num_batched_tokens: 2048\n"
                 "cpu_kv_cache_gib: 0.25\nenforce_eager: true\nlog_level: INFO\n"
                 "server:\n  shutdown_grace_s: 2\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server (then --pids names its ranks' pids)")
    ap.add_argument("--pids", help="comma-separated pids of the ranks of --base-url, rank 0 first")
    ap.add_argument("--api-processes", type=int,
                    help="HTTP frontend processes of the server this script starts (server.api_processes)")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the server this script starts")
    ap.add_argument("--model", help="checkpoint of the server this script starts (default: the tiny test model)")
    ap.add_argument("--storms", type=int, default=7, help="storms, the first one a warm-up")
    ap.add_argument("--requests", type=int, default=360, help="streaming requests per storm")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--max-chunks", type=int, default=6, help="a client drops its stream after 0..N chunks")
    ap.add_argument("--timeout-every", type=int, default=10, help="every N-th request times out instead (0: none)")
    ap.add_argument("--window", type=int, default=3, help="storms over which the growth is judged")
    ap.add_argument("--max-growth-mb", type=float, help="fail when a rank grows more than this over the window")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # runs the finally below: the server is stopped too
    proc = None
    try:
        if args.base_url:
            if not args.pids:
                ap.error("--base-url needs --pids")
            base_url = args.base_url
            pids = {f"rank {r}": int(p) for r, p in enumerate(args.pids.split(","))}
        else:
            log = Path(tempfile.mkdtemp(prefix="rtp-soak-")) / "server.log"
            print(f"starting a TP={args.tp} server (log: {log})", flush=True)
            config = SERVER_CONFIG
            if args.api_processes is not None:
                config += f"  api_processes: {args.api_processes}\n"
            proc, base_url = start_server(args.tp, args.model, config, log)
            pids = server_pids(proc.pid)
        curve, failures = soak(base_url, pids, args.storms, args.requests, args.clients, args.max_chunks,
                               args.timeout_every)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    grown = growth(curve, args.window)
    print(f"growth over the last {args.window} storms: "
          + ", ".join(f"{name} {mb:+.1f} MB" for name, mb in grown.items()))
    if args.max_growth_mb is not None:
        failures += [f"{name} grew {mb:.1f} MB > {args.max_growth_mb} MB" for name, mb in grown.items()
                     if mb > args.max_growth_mb]
    for f in failures[:20]:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
