"""launch/serve.py loses a rank under load: every client gets an answer and the server exits non-zero.

torchrun, TP=2 on CPU, with a short ``liveness_timeout_s`` so the test costs
a few seconds beyond its bound.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from rtp.distributed.liveness import pid_alive
from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import kill, launch, read_stream, shm_segments, wait_ready, wait_streaming
from tests.utils import rank_pids

pytestmark = pytest.mark.slow

LIVENESS_S = 4.0
CLIENTS = 32
MAX_NUM_SEQS = 8  # so that most of the clients' requests are queued, not running, when the rank is lost


def late_requests(url: str, stop: threading.Event, outcomes: list[str]) -> None:
    """New requests, one after another, until the server is gone: each outcome is a status or an error name."""
    body = {"prompt": "late", "max_tokens": 4}
    while not stop.is_set():
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            outcomes.append(str(r.status_code) if r.status_code != 503 else "503:" + r.json()["error"]["message"])
        except httpx.TimeoutException:
            outcomes.append("timeout")
            return
        except httpx.TransportError as e:  # refused or reset: the server has exited
            outcomes.append(type(e).__name__)
            return
        time.sleep(0.05)


def health_probe(url: str, stop: threading.Event, seen: list[tuple[int, dict]]) -> None:
    while not stop.is_set():
        try:
            r = httpx.get(url + "/health", timeout=5)
            seen.append((r.status_code, r.json()))
        except httpx.TransportError:
            return
        time.sleep(0.02)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api_processes", [0, 1], ids=["in-process", "frontend"])
def test_a_stopped_worker_under_load_fails_every_request_and_the_server_exits(tmp_path, api_processes):
    config = tmp_path / "cpu.yaml"
    config.write_text(
        f"model: {default_model_dir()}\n"  # the random tiny model (the default is the trained one)
        f"device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: {MAX_NUM_SEQS}\ncpu_kv_cache_gib: 0.25\n"
        f"enforce_eager: true\nliveness_timeout_s: {LIVENESS_S}\nserver:\n  shutdown_grace_s: 4\n"
    )
    server = launch(tmp_path, "faulty", config, "--api-server-count", str(api_processes))
    pids: dict[int, int] = {}
    try:
        wait_ready(server)
        pids = rank_pids(server.proc.pid)
        assert sorted(pids) == [0, 1] and pids[0] == server.rank0_pid
        results: list[dict] = [{} for _ in range(CLIENTS)]
        clients = [
            threading.Thread(target=read_stream, args=(server.url, {"prompt": f"Story {i}:", "max_tokens": 1900,
                                                                    "ignore_eos": True, "stream": True}, results[i]))
            for i in range(CLIENTS)
        ]
        for t in clients:
            t.start()
        wait_streaming(results, MAX_NUM_SEQS, 60, "the running requests")

        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        stop = threading.Event()
        late: list[str] = []
        health: list[tuple[int, dict]] = []
        probes = [threading.Thread(target=late_requests, args=(server.url, stop, late)),
                  threading.Thread(target=health_probe, args=(server.url, stop, health))]
        for t in probes:
            t.start()
        for t in clients:
            t.join(max(0.0, t0 + LIVENESS_S + 20 - time.monotonic()))
        hanging = sum(t.is_alive() for t in clients)
        assert hanging == 0, f"{hanging} clients got no answer:\n{server.text()[-4000:]}"
        rc = server.proc.wait(30)
        elapsed = time.monotonic() - t0
        stop.set()
        for t in probes:
            t.join(60)

        # Every client, running or queued, got its stream ended with an OpenAI error event naming the rank.
        cause = f"rank 1 (pid {pids[1]}) stopped responding: no heartbeat for"
        for i, r in enumerate(results):
            assert r["done"] and r["finish"] is None, (i, r)
            assert isinstance(r["error"], dict) and r["error"]["code"] == "service_unavailable", (i, r)
            assert cause in r["error"]["message"], (i, r)
        assert sum(bool(r.get("started")) for r in results) < CLIENTS  # some were still queued
        # New requests: refused with 503 naming the cause, then nothing listens any more; none hangs.
        assert late and late[0].startswith("503:") and cause in late[0], late
        assert all(o.startswith("503:") for o in late[:-1]) and late[-1] not in ("timeout", "200"), late
        for status, body in health:  # /health never claims to be fine while a rank is lost, and says why
            assert status == 200 or (status == 503 and cause in body["reason"]), (status, body)
        assert rc != 0
        assert elapsed < LIVENESS_S + 15, f"exited after {elapsed:.1f} s"
        assert not any(pid_alive(p) for p in pids.values())
        assert shm_segments(pids[0]) == []
        assert cause in server.text()
    finally:
        kill(server)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
