"""Load test of a running rtp server: concurrent clients, mixed requests, malformed ones in between.

    python scripts/load_test.py --base-url http://127.0.0.1:8000 --clients 32 --requests 500 --malformed 50

Every good request (completions and chat, streaming and not, in turn) must
come back complete: HTTP 200, at least one generated token, a finish_reason,
and for streams a final ``data: [DONE]``. Every malformed request must get a
4xx with an OpenAI error body. Any 5xx, timeout or incomplete answer is a
failure; the exit code is 1 if there was any. Prints p50/p99 latency and
throughput. Loopback only unless --allow-remote is given.

``--features mix`` gives the good requests, in turn, one sampling feature each:
none, penalties (presence, frequency, repetition), n=2 (every choice must
finish), echo with logprobs (completions; chat gets logprobs), logit_bias, and
with ``--structured`` a JSON schema (chat: response_format, completions:
guided_json). Compare its generated tok/s with a run without ``--features``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

KINDS = ("completion", "completion-stream", "chat", "chat-stream")
FEATURES = ("plain", "penalties", "n2", "echo-logprobs", "logit_bias", "json_schema")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name"]}


@dataclass
class Job:
    kind: str  # one of KINDS, or "malformed"
    body: bytes
    path: str
    stream: bool = False
    expect: str = ""  # what a malformed request is
    n: int = 1  # choices expected
    echo: str | None = None  # the prompt a completion must start with


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    good: int = 0
    rejected: int = 0
    failures: list[str] = field(default_factory=list)


def good_job(i: int, model: str, max_tokens: int, features: tuple[str, ...] = ("plain",)) -> Job:
    kind = KINDS[i % len(KINDS)]
    stream = kind.endswith("stream")
    common: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True,
                    "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    chat = kind.startswith("chat")
    feature = features[(i // len(KINDS)) % len(features)]  # every feature meets every kind
    prompt = f"Request {i}: once upon a time"
    n, echo = 1, None
    if feature == "penalties":
        common.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    elif feature == "n2":
        common["n"] = n = 2
    elif feature == "echo-logprobs":
        if chat:
            common.update(logprobs=True, top_logprobs=2)
        else:
            common.update(echo=True, logprobs=2)
            echo = None if stream else prompt
    elif feature == "logit_bias":
        common["logit_bias"] = {str(t): b for t, b in ((11, 5.0), (12, -5.0), (13, 2.5))}
    elif feature == "json_schema":
        common.pop("ignore_eos")
        if chat:
            common["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        else:
            common["guided_json"] = SCHEMA
    if chat:
        body = {"messages": [{"role": "user", "content": f"Tell me about request number {i}."}], **common}
        return Job(f"{kind}/{feature}", json.dumps(body).encode(), "/v1/chat/completions", stream, n=n)
    body = {"prompt": prompt, **common}
    return Job(f"{kind}/{feature}", json.dumps(body).encode(), "/v1/completions", stream, n=n, echo=echo)


def malformed_job(i: int, model: str, max_model_len: int) -> Job:
    cases: list[tuple[str, str, object]] = [
        ("invalid JSON", "/v1/completions", b'{"prompt": "a", "max_tokens": '),
        ("wrong type", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": "eight"}),
        ("negative max_tokens", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": -1}),
        ("unknown model", "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user",
                                                                                            "content": "hi"}]}),
        ("n too large", "/v1/completions", {"model": model, "prompt": "a", "n": 1000}),
        ("no messages", "/v1/chat/completions", {"model": model, "messages": []}),
        ("prompt too long", "/v1/completions", {"model": model, "prompt": [1] * (max_model_len + 1)}),
        ("not an object", "/v1/chat/completions", b"[]"),
    ]
    what, path, body = cases[i % len(cases)]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Job("malformed", raw, path, expect=what)


async def run_job(client: httpx.AsyncClient, job: Job, res: Results) -> None:
    headers = {"content-type": "application/json"}
    start = time.perf_counter()
    try:
        if job.stream:
            await check_stream(client, job, headers, res)
        else:
            r = await client.post(job.path, content=job.body, headers=headers)
            check_response(job, r, res)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
        res.failures.append(f"{job.kind} {job.expect}: {type(e).__name__}: {e}")
        return
    if job.kind != "malformed":
        res.latencies.append(time.perf_counter() - start)


def check_response(job: Job, r: httpx.Response, res: Results) -> None:
    if job.kind == "malformed":
        if 400 <= r.status_code < 500 and "error" in r.json():
            res.rejected += 1
        else:
            res.failures.append(f"malformed ({job.expect}) got {r.status_code}: {r.text[:200]}")
        return
    if r.status_code != 200:
        res.failures.append(f"{job.kind} got {r.status_code}: {r.text[:200]}")
        return
    body = r.json()
    choices = body["choices"]
    completion = body["usage"]["completion_tokens"]
    if (completion < 1 or len(choices) != job.n or not all(c.get("finish_reason") for c in choices)
            or sorted(c["index"] for c in choices) != list(range(job.n))):
        res.failures.append(f"{job.kind} incomplete: {json.dumps(body)[:300]}")
        return
    if job.echo is not None and not choices[0]["text"].startswith(job.echo):
        res.failures.append(f"{job.kind} does not echo its prompt: {json.dumps(body)[:300]}")
        return
    res.good += 1
    res.tokens += completion


async def check_stream(client: httpx.AsyncClient, job: Job, headers: dict[str, str], res: Results) -> None:
    async with client.stream("POST", job.path, content=job.body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            res.failures.append(f"{job.kind} got {r.status_code}: {r.text[:200]}")
            return
        finished: set[int] = set()
        usage, done = None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                res.failures.append(f"{job.kind} error event: {data[:200]}")
                return
            for choice in event["choices"]:
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
            usage = event.get("usage") or usage
    if not done or finished != set(range(job.n)) or usage is None or usage["completion_tokens"] < 1:
        res.failures.append(f"{job.kind} stream incomplete: done={done} finished={finished} usage={usage}")
        return
    res.good += 1
    res.tokens += usage["completion_tokens"]


async def main_async(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.request_timeout,
                                 limits=limits) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        card = r.json()["data"][0]
        model, max_model_len = card["id"], int(card.get("max_model_len", 2048))
        features = ("plain",)
        if args.features == "mix":
            features = tuple(f for f in FEATURES if f != "json_schema" or args.structured)
        jobs = [good_job(i, model, args.max_tokens, features) for i in range(args.requests)]
        jobs += [malformed_job(i, model, max_model_len) for i in range(args.malformed)]
        random.Random(args.seed).shuffle(jobs)
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        res = Results()

        async def worker() -> None:
            while not queue.empty():
                await run_job(client, queue.get_nowait(), res)

        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(args.clients))), args.total_timeout)
        except asyncio.TimeoutError:
            res.failures.append(f"did not finish within {args.total_timeout} s ({queue.qsize()} jobs not started)")
        elapsed = time.perf_counter() - start
    report(res, args, elapsed)
    return 1 if res.failures or res.good != args.requests or res.rejected != args.malformed else 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def report(res: Results, args: argparse.Namespace, elapsed: float) -> None:
    print(f"{res.good}/{args.requests} good requests answered, {res.rejected}/{args.malformed} malformed "
          f"rejected with 4xx, {len(res.failures)} failures in {elapsed:.1f} s")
    print(f"latency p50 {percentile(res.latencies, 50) * 1000:.0f} ms, p99 {percentile(res.latencies, 99) * 1000:.0f}"
          f" ms; throughput {res.good / elapsed:.1f} req/s, {res.tokens / elapsed:.0f} generated tok/s")
    for failure in res.failures[:20]:
        print(f"FAIL {failure}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=500, help="good requests")
    ap.add_argument("--malformed", type=int, default=50, help="malformed requests mixed in")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--api-key")
    ap.add_argument("--seed", type=int, default=0, help="order of the requests")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--total-timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--allow-remote", action="store_true", help="allow a base URL that is not loopback")
    ap.add_argument("--features", choices=("none", "mix"), default="none",
                    help="mix: give the good requests sampling features in turn (see above)")
    ap.add_argument("--structured", action="store_true", help="with --features mix: include JSON-schema outputs")
    args = ap.parse_args()
    host = urlparse(args.base_url).hostname or ""
    if not args.allow_remote and host not in ("127.0.0.1", "localhost", "::1"):
        ap.error(f"--base-url {args.base_url} is not loopback; pass --allow-remote to load a remote server")
    for name in ("clients", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.malformed < 0:
        ap.error("--malformed must be >= 0")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
