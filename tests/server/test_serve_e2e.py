"""launch/serve.py through torchrun at TP=2 on CPU, driven by the official openai client.

Two servers are started once for the module (together, to share the startup
time): a plain one and one with an API key. The tests run in file order; the
last two stop the servers with SIGTERM and check the shutdown.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.testing import default_model_dir
from tests.utils import REPO, rank_pids, with_positions

pytestmark = pytest.mark.slow

GRACE_S = 4.0  # server.shutdown_grace_s of the test servers
STATS_S = 1.0  # server.log_stats_interval_s of the test servers
API_KEY = "test-key-123"
PROMPTS = ["The quick brown fox", "Once upon a time", "What time is it?"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 16


@dataclass
class Server:
    proc: subprocess.Popen
    log: Path
    url: str = ""
    rank0_pid: int = 0

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def launch(tmp: Path, name: str, config: Path, *args: str) -> Server:
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "launch/serve.py", "--config", str(config), "--port", "0", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, killed in teardown
    return Server(proc, log)


def wait_ready(server: Server, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = server.text()
        m = re.search(r"serving on (http://\S+)", text)
        if m:
            server.url = m.group(1)
            server.rank0_pid = rank_pids(server.proc.pid)[0]  # uvicorn's pid is a frontend's with api_processes
            return
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode}:\n{text[-5000:]}")
        time.sleep(0.2)
    pytest.fail(f"the server did not start within {timeout} s:\n{server.text()[-5000:]}")


def kill(server: Server) -> None:
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.proc.wait(30)


def shm_segments(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"rtp_{pid}_*")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    config = tmp / "cpu.yaml"
    config.write_text(
        f"model: {default_model_dir()}\n"  # the random tiny model (the default is the trained one)
        "device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 64\nmax_num_batched_tokens: 2048\n"
        f"cpu_kv_cache_gib: 0.25\nenforce_eager: true\nlog_level: INFO\nserver:\n  shutdown_grace_s: {GRACE_S}\n"
        f"  log_stats_interval_s: {STATS_S}\n"
    )
    # The plain server serves HTTP in rank 0's process, the keyed one from an API frontend process
    # (so the key, the metrics and the SIGTERM to torchrun are checked across the process split too).
    started = [launch(tmp, "plain", config, "--api-server-count", "0"),
               launch(tmp, "keyed", config, "--api-key", API_KEY, "--api-server-count", "1")]
    try:
        for s in started:
            wait_ready(s)
        yield {"plain": started[0], "keyed": started[1], "tmp": tmp}
    finally:
        for s in started:
            kill(s)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["plain"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_metric(url: str, name: str, value: float, headers: dict | None = None, timeout: float = 10) -> float:
    """Poll /metrics until ``name`` reads ``value`` or ``timeout`` seconds pass; the last reading."""
    deadline = time.time() + timeout
    while (got := metric(url, name, headers)) != value and time.time() < deadline:
        time.sleep(0.1)
    return got


def offline_reference(tmp: Path, prompts: list[str]) -> list[dict]:
    """rtp's offline path (launch/generate.py, TP=1) on the same prompts, greedy."""
    lines = [{"prompt": p, "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in prompts]
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run([sys.executable, "launch/generate.py", "--config", str(tmp / "cpu.yaml"),
                           "--prompts-file", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- serving


@pytest.mark.timeout(600)
def test_greedy_output_equals_offline_generate(servers, server, client):
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    chat_prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ref = offline_reference(servers["tmp"], PROMPTS + [chat_prompt])
    keyed = openai.OpenAI(base_url=servers["keyed"].url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for c in (client, keyed):  # HTTP in rank 0's process, and in an API frontend process
        _check_greedy(c, tok, ref)


def _check_greedy(client: openai.OpenAI, tok, ref: list[dict]) -> None:
    extra = {"ignore_eos": True}
    model = client.models.list().data[0].id
    for prompt, want in zip(PROMPTS, ref):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra)
        assert r.choices[0].text == want["text"] and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == len(want["token_ids"]) == MAX_TOKENS
        assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=extra)
    assert r.choices[0].message.content == ref[-1]["text"] and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body=extra)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref[-1]["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["plain", "keyed"])  # outputs in rank 0's process, and over the frontend wire
def test_prompt_logprobs_rank_every_prompt_token_as_hf(servers, name):
    """vLLM's prompt_logprobs rank a prompt token outside the top ones too: the tokens at least as likely as it
    (here from HF transformers' logits)."""
    prompt = " ".join(PROMPTS)
    ids = AutoTokenizer.from_pretrained(str(default_model_dir())).encode(prompt, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # [len, vocab]
    key = API_KEY if name == "keyed" else "unused"
    client = openai.OpenAI(base_url=servers[name].url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=1,
                                  temperature=0, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ranks = [plp[i][str(ids[i])]["rank"] for i in range(1, len(ids))]
    assert all(isinstance(rank, int) for rank in ranks) and max(ranks) > 1, ranks  # tokens outside the top one
    for i, rank in enumerate(ranks, 1):
        row, lp = ref[i - 1], ref[i - 1, ids[i]]
        assert (row > lp + 1e-4).sum().item() < rank <= (row >= lp - 1e-4).sum().item(), (i, rank)


@pytest.mark.timeout(300)
def test_load_mixed_concurrent_and_malformed_requests(server):
    proc = subprocess.run([sys.executable, "scripts/load_test.py", "--base-url", server.url, "--clients", "32",
                           "--requests", "500", "--malformed", "50", "--max-tokens", "8", "--total-timeout", "240"],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "500/500 good requests answered, 50/50 malformed" in proc.stdout
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.timeout(120)
def test_bad_requests_over_http(server, client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=model, prompt=[1] * 5000, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=0)
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = json.dumps({"model": model, "prompt": "a" * (1 << 20)}).encode()  # over the default 1 MiB limit
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.completions.create(model=model, prompt="still serving", max_tokens=2).choices[0].finish_reason


@pytest.mark.timeout(120)
def test_client_disconnect_frees_the_kv_cache(server):
    idle = metric(server.url, "rtp_kv_cache_usage_ratio")
    aborted = metric(server.url, 'rtp_requests_finished_total{finish_reason="abort"}') \
        if "abort" in httpx.get(server.url + "/metrics").text else 0.0
    body = {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):  # a few tokens in: the request holds KV blocks now
            next(lines)
        assert metric(server.url, "rtp_kv_cache_usage_ratio") > idle
    assert wait_for_metric(server.url, "rtp_kv_cache_usage_ratio", idle, timeout=20) == idle
    assert metric(server.url, 'rtp_requests_finished_total{finish_reason="abort"}') == aborted + 1


@pytest.mark.timeout(120)
def test_api_key_is_enforced(servers):
    keyed = servers["keyed"]
    good = {"Authorization": f"Bearer {API_KEY}"}
    before = metric(keyed.url, "rtp_generation_tokens_total", good)
    assert httpx.get(keyed.url + "/health").status_code == 200
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="x", prompt="a", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="x", messages=CHAT, max_tokens=4, stream=True)
    assert metric(keyed.url, "rtp_generation_tokens_total", good) == before  # nothing was generated
    right = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    r = right.completions.create(model=right.models.list().data[0].id, prompt="a", max_tokens=4,
                                 extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert metric(keyed.url, "rtp_generation_tokens_total", good) == before + 4
    # One frontend keeps its metrics in memory: no multiprocess files (several frontends: test_serve_frontends).
    assert not list(Path(tempfile.gettempdir()).glob(f"rtp_metrics_{keyed.rank0_pid}_*"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["plain", "keyed"])  # the engine thread in rank 0's process, and EngineLoop
def test_the_log_says_what_the_engine_did(servers, name):
    srv = servers[name]
    headers = {"Authorization": f"Bearer {API_KEY}"} if name == "keyed" else {}
    line = re.compile(r"prefill ([\d.]+) tok/s, generation ([\d.]+) tok/s, running (\d+), waiting (\d+), "
                      r"KV cache ([\d.]+)%, prefix cache hits (\S+), preemptions (\d+)")
    seen = len(line.findall(srv.text()))
    r = httpx.post(srv.url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": "The log", "max_tokens": 48, "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
    # The lines of the intervals with work come up to ~2 intervals after the request ended: wait until the log is
    # quiet for 3 intervals (idle intervals write no line), then check those lines covered the request.
    deadline, count, quiet_since = time.monotonic() + 20 * STATS_S + 10, seen, time.monotonic()
    while time.monotonic() - quiet_since < 3 * STATS_S:
        assert time.monotonic() < deadline, f"the {name} server's log never went quiet:\n{srv.text()[-3000:]}"
        time.sleep(0.2)
        if (now_count := len(line.findall(srv.text()))) != count:
            count, quiet_since = now_count, time.monotonic()
    new = line.findall(srv.text())[seen:]
    assert new, f"no activity line in the {name} server's log:\n{srv.text()[-3000:]}"
    assert sum(float(g) for _, g, *_ in new) > 0  # the 48 tokens were generated in these intervals
    assert sum(float(p) for p, *_ in new) > 0  # and the prompt computed


# ---------------------------------------------------------------------------- shutdown (keep these last)


def read_stream(url: str, body: dict, result: dict, headers: dict | None = None) -> None:
    """Stream a completion into result: text, finish and stop reason, error event, [DONE] seen."""
    result.update(text="", finish=None, stop_reason=None, error=None, done=False)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=60) as r:
            if r.status_code != 200:  # refused before its stream began (a 503 once the engine is lost)
                result["error"] = f"{r.status_code}: {r.read().decode(errors='replace')}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result["error"] = event["error"]
                    continue
                result["started"] = True
                result["text"] += event["choices"][0]["text"]
                result["finish"] = event["choices"][0]["finish_reason"] or result["finish"]
                result["stop_reason"] = event["choices"][0].get("stop_reason", result["stop_reason"])
    except httpx.HTTPError as e:
        result["error"] = repr(e)


def wait_streaming(results: list[dict], n: int, timeout: float, what: str) -> None:
    """Wait until ``n`` of :func:`read_stream`'s results have started streaming; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while sum(bool(r.get("started")) for r in results) < n:
        assert time.monotonic() < deadline, f"{what} did not start streaming: {results}"
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("frontends", ["0", "1"])
def test_sigterm_finishes_short_requests_and_aborts_long_ones_after_the_grace(servers, frontends):
    # A server of its own with a long context: 8000 tokens take several times the grace even on a fast
    # decode path (the tiny model's 2048 positions allowed only ~4 s, about the grace itself).
    config = servers["tmp"] / f"long{frontends}.yaml"
    model = with_positions(Path(shutil.copytree(default_model_dir(), servers["tmp"] / f"long-model{frontends}")),
                           8192)
    base = (servers["tmp"] / "cpu.yaml").read_text().replace(str(default_model_dir()), str(model))
    config.write_text(base.replace("max_num_seqs: 64", "max_num_seqs: 64\nmax_model_len: 8192")
                      + "  max_tokens_limit: 8192\n")
    server = launch(servers["tmp"], f"grace{frontends}", config, "--api-server-count", frontends)
    try:
        wait_ready(server)
        _sigterm_during_a_short_and_a_long_request(server)
    finally:
        kill(server)


def _sigterm_during_a_short_and_a_long_request(server: Server) -> None:
    short, long_ = {}, {}
    threads = [
        threading.Thread(target=read_stream, args=(server.url, {"prompt": "a", "max_tokens": 40, "ignore_eos": True,
                                                                "stream": True}, short)),
        threading.Thread(target=read_stream, args=(server.url, {"prompt": "b", "max_tokens": 8000,
                                                                "ignore_eos": True, "stream": True}, long_)),
    ]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while not (short.get("started") and long_.get("started")) and time.time() < deadline:
        time.sleep(0.02)
    start = time.time()
    os.kill(server.rank0_pid, signal.SIGTERM)  # rank 0 itself: torchrun then sees every rank exit 0
    _new_clients_are_refused_while_it_drains(server.url)
    rc = server.proc.wait(GRACE_S + 30)
    elapsed = time.time() - start
    for t in threads:
        t.join(10)
    assert rc == 0, server.text()[-4000:]
    assert elapsed < GRACE_S + 20
    assert short["finish"] == "length" and short["done"] and short["error"] is None
    assert long_["finish"] is None and long_["done"] and long_["error"]["code"] == "service_unavailable"
    assert shm_segments(server.rank0_pid) == []
    assert "rtp.runtime.coordinator: shut down" in server.text()


def _new_clients_are_refused_while_it_drains(url: str) -> None:
    """Within a few seconds of the stop nobody listens: a new connection is refused at once (it was left
    waiting, unanswered, in the listening socket's backlog while any process still held the socket).

    A connection the kernel completed just before the listener closed is reset by that close: it raced the
    stop and was answered within moments, so a quick reset counts as refused; a slow one, or a timeout, means
    the connection sat unanswered in a backlog."""
    deadline = time.time() + 5
    while True:
        t0 = time.monotonic()
        try:
            httpx.get(url + "/health", timeout=2)  # answered: the listener has not closed yet
        except httpx.ConnectError:
            return
        except (httpx.ReadError, httpx.RemoteProtocolError) as e:
            waited = time.monotonic() - t0
            if waited < 0.5:
                return
            raise AssertionError(f"a new client waited {waited:.2f} s during the drain, then: {e!r}") from None
        except httpx.TransportError as e:  # a timeout: the connection was taken and never served
            raise AssertionError(f"a new client was left waiting during the drain: {e!r}") from None
        assert time.time() < deadline, "the server still accepted connections 5 s into its stop"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_sigterm_to_torchrun_shuts_down_cleanly(servers):
    keyed = servers["keyed"]
    start = time.time()
    keyed.proc.send_signal(signal.SIGTERM)
    rc = keyed.proc.wait(GRACE_S + 30)
    assert time.time() - start < GRACE_S + 20
    log = keyed.text()
    # torchrun forwards SIGTERM to every rank and then ends with its own SignalException (exit 1);
    # what matters is that rank 0 stopped the server and the workers cleanly.
    assert rc in (0, 1, -signal.SIGTERM, 128 + signal.SIGTERM), log[-4000:]
    assert "rtp.runtime.coordinator: shut down" in log
    assert not re.search(r"\[rank\d\] (ERROR|CRITICAL)", log), log[-4000:]
    assert shm_segments(keyed.rank0_pid) == []
