"""launch/serve.py with API frontend processes (server.api_processes = 2), TP=2 on CPU through torchrun.

Checked against HF transformers' greedy continuation: outputs streamed and not, a stop string matched in a
frontend (and the request aborted in the engine), /metrics summed over the frontends, 4xx answers, the
API key, a client disconnect. Then the exits: a frontend SIGKILLed under load (the server exits non-zero,
no rank, frontend or segment left) and SIGTERM (running requests finish, exit 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rtp.distributed.liveness import pid_alive
from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import (
    Server,
    kill,
    launch,
    metric,
    read_stream,
    shm_segments,
    wait_for_metric,
    wait_ready,
)
from tests.utils import hf_greedy, with_generation_config, with_positions

pytestmark = pytest.mark.slow

API_KEY = "frontend-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 4.0


def frontend_pids(rank0_pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(rank0_pid), "-o", "pid=,args="], capture_output=True, text=True)
    return [int(line.split()[0]) for line in out.stdout.splitlines() if "rtp.server.frontend" in line]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontends")
    config = tmp / "cpu.yaml"
    config.write_text(
        f"model: {default_model_dir()}\n"
        "device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 16\ncpu_kv_cache_gib: 0.25\n"
        f"enforce_eager: true\nliveness_timeout_s: 5\nserver:\n  shutdown_grace_s: {GRACE_S}\n  api_processes: 2\n"
    )
    # The SIGTERM server has a long context: 8000 tokens take several times the grace. Its checkpoint (a copy)
    # recommends greedy decoding in generation_config.json: the frontend must apply it to requests.
    greedy_model = with_positions(with_generation_config(default_model_dir(), tmp / "greedy-model", temperature=0.0,
                                                         top_p=0.5), 8192)
    long = tmp / "long.yaml"
    long.write_text(config.read_text().replace(str(default_model_dir()), str(greedy_model))
                    .replace("max_num_seqs: 16", "max_num_seqs: 16\nmax_model_len: 8192")
                    .replace("api_processes: 2", "api_processes: 1") + "  max_tokens_limit: 8192\n")
    started = [launch(tmp, "keyed", config, "--api-key", API_KEY), launch(tmp, "grace", long)]
    try:
        for s in started:
            wait_ready(s)
        yield {"keyed": started[0], "grace": started[1]}
    finally:
        for s in started:
            kill(s)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["keyed"]


@pytest.fixture(scope="module")
def reference():
    """HF transformers' greedy continuation of a prompt (ids and text)."""
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), torch_dtype=torch.float32)
    prompt = "Once upon a time"
    ids = hf_greedy(model, tok.encode(prompt, add_special_tokens=False), 24)
    return prompt, ids, tok.decode(ids)


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH if headers is None else headers, timeout=60)


def test_the_server_runs_two_frontends_beside_rank_0(server):
    pids = frontend_pids(server.rank0_pid)
    assert len(pids) == 2
    assert "2 API frontend process(es)" in server.text()


def test_greedy_output_equals_hf_streamed_and_not(server, reference):
    prompt, ids, text = reference
    body = {"prompt": prompt, "max_tokens": len(ids), "temperature": 0, "ignore_eos": True}
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == len(ids)
    streamed: dict = {}
    read_stream_keyed(server.url, {**body, "stream": True}, streamed)
    assert streamed["text"] == text and streamed["finish"] == "length" and streamed["done"]


def read_stream_keyed(url: str, body: dict, result: dict) -> None:
    read_stream(url, body, result, AUTH)


def test_a_stop_string_ends_the_request_in_the_engine(server, reference):
    prompt, ids, text = reference
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    r = post(server.url, {"prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                          "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    # The engine aborted it at once instead of running on to 1000 tokens.
    assert wait_for_metric(server.url, "rtp_requests_running", 0, AUTH) == 0
    # A stop token ends it in the engine: stop_reason is its id, in the stream's last chunk too.
    body = {"prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stop_token_ids": [ids[3]]}
    choice = post(server.url, body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[3])
    streamed: dict = {}
    read_stream_keyed(server.url, {**body, "stream": True}, streamed)
    assert (streamed["finish"], streamed["stop_reason"], streamed["text"]) == ("stop", ids[3], choice["text"])


def test_continuous_usage_counts_each_choices_own_tokens(server):
    body = {"prompt": "Once", "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        seen[e["choices"][0]["index"]].append(e["usage"]["completion_tokens"])
    assert all(v and v == sorted(v) and v[-1] == 5 for v in seen.values()), seen  # not the sum over choices
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


def test_a_grammar_reaches_the_engine(server):
    choices = ["yes please", "no thanks"]
    for seed in range(3):
        r = post(server.url, {"prompt": "Answer:", "max_tokens": 20, "seed": seed, "guided_choice": choices})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in choices
    r = post(server.url, {"prompt": "Answer:", "max_tokens": 20, "guided_regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_metrics_are_summed_over_the_frontends(server):
    before = metric(server.url, "rtp_generation_tokens_total", AUTH)
    for _ in range(8):  # new connections: the kernel spreads them over both frontends
        assert post(server.url, {"prompt": "a", "max_tokens": 3, "ignore_eos": True}).status_code == 200
    for _ in range(4):  # every frontend answers with the sum
        assert metric(server.url, "rtp_generation_tokens_total", AUTH) == before + 24
        assert metric(server.url, "vllm:generation_tokens_total", AUTH) == before + 24


def test_bad_input_gets_4xx_and_the_key_is_enforced(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server.url, {"prompt": "a", "max_tokens": 4}, headers={}).status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    r = post(server.url, {"prompt": "a " * 5000, "max_tokens": 4})
    assert r.status_code == 400 and "2047 prompt tokens" in r.json()["error"]["message"]
    r = post(server.url, {"prompt": "a", "max_tokens": 4, "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400
    r = post(server.url, {"prompt": [10**9], "max_tokens": 4})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_a_client_disconnect_aborts_in_the_engine(server):
    body = {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        # /metrics may be answered by the other frontend, which gets the engine's stats every 0.5 s only
        assert wait_for_metric(server.url, "rtp_requests_running", 1, AUTH) == 1
    assert wait_for_metric(server.url, "rtp_requests_running", 0, AUTH) == 0
    assert metric(server.url, "rtp_kv_cache_usage_ratio", AUTH) == 0


def test_a_killed_frontend_ends_the_server_with_nothing_left(server):
    results = [{} for _ in range(6)]
    clients = [threading.Thread(target=read_stream_keyed, args=(server.url, {
        "prompt": f"Story {i}:", "max_tokens": 1900, "ignore_eos": True, "stream": True}, results[i]))
        for i in range(len(results))]
    for t in clients:
        t.start()
    deadline = time.time() + 60
    while sum(bool(r.get("started")) for r in results) < len(results) and time.time() < deadline:
        time.sleep(0.05)
    ranks = [server.rank0_pid, *_other_ranks(server)]
    frontends = frontend_pids(server.rank0_pid)
    t0 = time.monotonic()
    os.kill(frontends[0], signal.SIGKILL)
    rc = server.proc.wait(30)
    elapsed = time.monotonic() - t0
    for t in clients:
        t.join(30)
    assert not any(t.is_alive() for t in clients)
    assert rc != 0 and elapsed < 15, (rc, elapsed)
    log = server.text()
    assert f"API frontend 0 (pid {frontends[0]}) exited with code -9" in log, log[-3000:]
    for r in results:  # an answer for everyone: the survivor's clients an error event, the others a reset
        assert r["finish"] is None and r["error"], r
    assert not any(pid_alive(p) for p in ranks + frontends)
    assert shm_segments(server.rank0_pid) == []
    assert not list(Path("/tmp").glob(f"rtp_metrics_{server.rank0_pid}_*"))


def test_a_hung_frontend_is_killed_and_ends_the_server(tmp_path):
    """A frontend stopped (SIGSTOP) keeps its socket open and, with light traffic, never fills it: its missing
    BEATs tell rank 0, which kills it and stops the server within liveness_timeout_s (it hung for ever)."""
    config = tmp_path / "cpu.yaml"
    config.write_text(f"model: {default_model_dir()}\ndevice: cpu\ndtype: float32\nblock_size: 16\n"
                      "cpu_kv_cache_gib: 0.25\nliveness_timeout_s: 3\nserver:\n  api_processes: 1\n")
    server = launch(tmp_path, "hung", config)
    try:
        wait_ready(server)
        assert post(server.url, {"prompt": "Hi", "max_tokens": 2}, headers={}).status_code == 200
        ranks = [server.rank0_pid, *_other_ranks(server)]
        (frontend,) = frontend_pids(server.rank0_pid)
        t0 = time.monotonic()
        os.kill(frontend, signal.SIGSTOP)
        rc = server.proc.wait(30)
        elapsed = time.monotonic() - t0
        log = server.text()
        assert rc != 0 and elapsed < 3 + 10, (rc, elapsed, log[-3000:])
        assert f"API frontend 0 (pid {frontend}) sent nothing for" in log, log[-3000:]
        assert not any(pid_alive(p) for p in [*ranks, frontend])
        assert shm_segments(server.rank0_pid) == []
    finally:
        kill(server)


def _other_ranks(server: Server) -> list[int]:
    from tests.utils import rank_pids

    return [p for r, p in rank_pids(server.proc.pid).items() if r != 0]


def test_the_checkpoints_sampling_defaults_reach_the_frontend(servers, reference):
    """A request that sets no temperature is decoded greedily (generation_config.json: temperature 0), one that
    sets temperature keeps it; a Response repeats the defaults it ran with."""
    url = servers["grace"].url
    prompt, ids, text = reference
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": len(ids), "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    r = httpx.post(url + "/v1/responses", json={"input": "Hello", "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 200 and (r.json()["temperature"], r.json()["top_p"]) == (0.0, 0.5), r.text
    sampled = {httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "ignore_eos": True,
                                                          "temperature": 1.0, "top_p": 1.0, "seed": seed},
                          timeout=60).json()["choices"][0]["text"] for seed in range(3)}
    assert len(sampled) > 1  # the request's own temperature won: three seeds, not one greedy text


def test_sigterm_lets_short_requests_finish_and_exits_0(servers):
    server = servers["grace"]
    short, long_ = {}, {}
    threads = [threading.Thread(target=read_stream, args=(server.url, {
                   "prompt": "a", "max_tokens": 30, "ignore_eos": True, "stream": True}, short)),
               threading.Thread(target=read_stream, args=(server.url, {
                   "prompt": "b", "max_tokens": 8000, "ignore_eos": True, "stream": True}, long_))]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while not (short.get("started") and long_.get("started")) and time.time() < deadline:
        time.sleep(0.02)
    frontends = frontend_pids(server.rank0_pid)
    os.kill(server.rank0_pid, signal.SIGTERM)
    try:
        rc = server.proc.wait(GRACE_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit {GRACE_S + 30:.0f} s after SIGTERM:\n{server.text()[-6000:]}")
    for t in threads:
        t.join(10)
    assert rc == 0, server.text()[-4000:]
    assert short["finish"] == "length" and short["done"] and short["error"] is None
    assert long_["done"] and long_["error"]["code"] == "service_unavailable", long_
    assert not any(pid_alive(p) for p in frontends)
    assert shm_segments(server.rank0_pid) == []
    assert "rtp.runtime.coordinator: shut down" in server.text()
