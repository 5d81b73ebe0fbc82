"""Schemathesis fuzzes a running server (launch/serve.py, tiny model, TP=1) from its own /openapi.json.

Every operation, a bounded number of examples per operation and a fixed seed,
one worker and no example database, so a run is repeatable. It asserts no
5xx, responses (JSON bodies and every server-sent event of a stream) that
match the documented schemas, documented status codes and content types,
schema-violating requests refused with a 4xx, undeclared methods answered
with a 405 and its Allow header, and a server that still generates afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rtp.testing import default_model_dir
from tests.server.test_serve_e2e import Server, kill, wait_ready
from tests.utils import REPO

pytestmark = pytest.mark.slow  # a torchrun server process, like test_serve_e2e

SEED = 14
MAX_EXAMPLES = 100
# Everything but positive_data_acceptance: some rules cannot be said in JSON Schema (top_logprobs needs
# logprobs=true, min_tokens <= max_tokens, token ids below the vocabulary size, the context length, and
# 1.0 counts as an integer there while rtp wants 1), so schema-valid requests may still get a 400.
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,negative_data_rejection,unsupported_method")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("fuzz")
    config = tmp / "cpu.yaml"
    # Small output limits keep every fuzzed generation short; the model really generates.
    config.write_text(
        f"model: {default_model_dir()}\n"  # the random tiny model (the default is the trained one)
        "device: cpu\ndtype: float32\nblock_size: 16\nmax_num_seqs: 16\nmax_num_batched_tokens: 2048\n"
        "cpu_kv_cache_gib: 0.1\nenforce_eager: true\nlog_level: INFO\n"
        "server:\n  max_tokens_limit: 16\n  default_max_tokens: 8\n  shutdown_grace_s: 2\n"
    )
    log = tmp / "fuzz.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "launch/serve.py", "--config", str(config), "--port", "0",
           # Through an API frontend process: the same app as the single-process server, plus the
           # engine <-> frontend messages under every request the schema allows.
           "--api-server-count", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, killed in teardown
    s = Server(proc, log)
    try:
        wait_ready(s)
        yield s
    finally:
        kill(s)


def st_binary() -> str:
    found = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if found is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[test]'")
    return found


def run_st(location: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [st_binary(), "run", location, "--seed", str(SEED), "--workers", "1", "--generation-database", "none",
           "--checks", CHECKS, "--request-timeout", "60", "--no-color", "--suppress-health-check", "all", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, NO_COLOR="1", COLUMNS="120"))


@pytest.mark.timeout(300)
def test_schemathesis_finds_no_server_errors_and_no_schema_violations(server, tmp_path, capsys):
    proc = run_st(server.url + "/openapi.json", tmp_path, "--max-examples", str(MAX_EXAMPLES))
    out = proc.stdout + proc.stderr
    summary = re.search(r"^=+ (.* in [\d.]+s) =+$", out, re.MULTILINE)
    cases = re.search(r"^\s*(\d+) generated, (\d+) passed$", out, re.MULTILINE)
    with capsys.disabled():  # the summary belongs in the test output, -q or not
        print(f"\nschemathesis (seed {SEED}, {MAX_EXAMPLES} examples per operation, checks {CHECKS}): "
              f"{cases.group(0).strip() if cases else '?'}; {summary.group(1) if summary else '?'}")
    assert proc.returncode == 0, out[-8000:]
    assert summary is not None and summary.group(1).startswith("No issues found"), out[-4000:]
    # Every generated case passed every check (so no 5xx), and every operation was exercised.
    assert cases is not None and cases.group(1) == cases.group(2) and int(cases.group(1)) >= 10 * 10, out[-4000:]
    assert re.search(r"Tested:\s+10\b", out), out[-4000:]  # /tokenize, /detokenize, /version and /v1/responses included
    assert "WARNINGS" not in out, out[-4000:]  # e.g. an unresolvable $ref: part of the schema went unchecked
    # The server is healthy afterwards and still generates.
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 4,
                                                          "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.timeout(300)
def test_schemathesis_checks_response_bodies_and_stream_events(server, tmp_path):
    """Control: the same run against a schema that demands a field rtp never sends must fail, both for
    JSON bodies and for server-sent events, so the conformance check above really looks at them."""
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for name in ("CompletionResponse", "ChatCompletionChunk"):
        schema["components"]["schemas"][name]["required"].append("not_sent_by_rtp")
        schema["components"]["schemas"][name]["properties"]["not_sent_by_rtp"] = {"type": "string"}
    (tmp_path / "wrong.json").write_text(json.dumps(schema))
    proc = run_st(str(tmp_path / "wrong.json"), tmp_path, "--url", server.url, "--max-examples", "20",
                  "--phases", "coverage,fuzzing", "--continue-on-failure", "--include-path-regex", "completions$")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "Response violates schema" in out and "SSE event violates schema" in out, out[-4000:]
    failures = out[out.index("FAILURES"):]
    assert "POST /v1/completions" in failures and "POST /v1/chat/completions" in failures, out[-4000:]
