"""Two nodes on one machine: torchrun --nnodes 2, the second node in its own Linux namespaces.

Node 1 runs inside ``unshare --uts --mount --pid --fork --mount-proc`` with
its own hostname and a private tmpfs on /dev/shm, so the two nodes share no
shared memory, no pids and no hostname: only the loopback network joins them,
as the network joins two machines. Two ranks per node, TP = 4 (or TP = 2 x PP = 2, a pipeline
stage per node, or DP = 2 x TP = 2, a replica per node; one rank per node for the served DP = 2 x TP = 1),
gloo on CPU.

- greedy output of a batch of mixed-length prompts equals HF transformers and
  single-node TP = 4, token for token;
- SIGKILL of the whole node 1 (its pid namespace) mid-generation: node 0's
  processes exit non-zero within the liveness bound, naming a lost rank and
  its host, and leave nothing in /dev/shm;
- SIGKILL of every node-0 process: node 1's ranks and torchrun exit on their
  own within the bound, and node 1's private /dev/shm is empty afterwards;
- pipeline stages across the nodes (TP = 2 in each, PP = 2): greedy equals HF, and losing
  either node ends the other within the bound, naming the lost rank and its host;
- data-parallel replicas across the nodes: offline (DP = 2 x TP = 2, a replica per node, each
  with its own step channel and shared-memory all-reduce) greedy equals HF; a wrong
  --data-parallel-size-local fails every rank of both nodes before the model loads; served (DP = 2 x
  TP = 1, one rank per node, node 1's engine reached over TCP with a secret) greedy equals HF with
  requests pinned to each replica and unpinned, and losing node 1 (offline or under load) ends
  node 0 non-zero within the bound with the lost rank named, every client answered, nothing left behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rtp.distributed.pids import pid_alive
from rtp.distributed.shm_segment import remove_segment
from rtp.testing import default_model_dir
from tests.utils import REPO, hf_greedy, rank_pids, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LIVENESS_S = 4.0  # liveness_timeout_s of the failure tests
BOUND_S = LIVENESS_S + 8.0  # the bound plus relay delay, the exit grace and a loaded 2-core machine
LENGTHS = [1, 5, 17, 40, 90]
MAX_TOKENS = 8
NODE1 = "rtp-node1"
_NS = ["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc"]
_NS_SETUP = "mount --make-rprivate / && mount -t tmpfs tmpfs /dev/shm && hostname " + NODE1


def _namespaces_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux namespaces"
    try:
        probe = subprocess.run([*_NS, "sh", "-c", _NS_SETUP + " && [ -z \"$(ls -A /dev/shm)\" ]"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare is not available: {e}"
    if probe.returncode != 0:
        return f"unshare/mount/hostname in new namespaces not permitted here: {probe.stderr.strip()[:200]}"
    return None


_UNAVAILABLE = _namespaces_unavailable()
if _UNAVAILABLE:
    pytestmark.append(pytest.mark.skip(reason=_UNAVAILABLE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodes:
    """Node 0's torchrun on this host, node 1's inside new namespaces; both read in the background."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, nproc: int = 2,
                 script: str = "launch/generate.py", node0_args: tuple[str, ...] | None = None) -> None:
        """``node0_args`` (default: ``--output out0.jsonl``) go to node 0's ranks only."""
        self.port = port = free_port()
        common = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                  "--master-addr", "127.0.0.1", "--master-port", str(port)]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        extra = ("--output", str(tmp / "out0.jsonl")) if node0_args is None else node0_args
        node0 = [*common, "--node-rank", "0", script, *args, *extra]
        node1 = shlex.join([*common, "--node-rank", "1", script, *args])  # writes no output
        # Node 1's shell reports torchrun's exit code and what is left in its private /dev/shm.
        script = f'{_NS_SETUP} && {node1}; rc=$?; echo "NODE1 rc=$rc shm=[$(ls -A /dev/shm)]"; exit $rc'
        self.procs = [
            subprocess.Popen(node0, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True),
            subprocess.Popen([*_NS, "bash", "-c", script], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True),
        ]
        self.output = ["", ""]
        self.rank_pids: dict[int, int] = {}  # node 0's ranks
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(2)]
        for t in self._readers:
            t.start()

    def _read(self, node: int) -> None:
        for line in self.procs[node].stdout:  # type: ignore[union-attr]
            self.output[node] += line

    def wait_for(self, node: int, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output[node]:
            for p, out in zip(self.procs, self.output):
                assert p.poll() is None, f"a node exited early ({p.returncode}):\n{out[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output[node][-4000:]}"
            time.sleep(0.2)
        self.rank_pids.update(rank_pids(self.procs[0].pid))

    def wait(self, node: int, timeout: float) -> int:
        try:
            rc = self.procs[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # what each node said, not only the command that hung
            pytest.fail(f"node {node} did not exit within {timeout} s\nnode 0:\n{self.output[0][-3000:]}\n"
                        f"node 1:\n{self.output[1][-3000:]}")
        self._readers[node].join(10)
        return rc

    def kill_node1(self) -> None:
        """SIGKILL node 1's pid-namespace init (unshare's child): the kernel kills everything in it."""
        ps = subprocess.run(["ps", "--ppid", str(self.procs[1].pid), "-o", "pid="], capture_output=True, text=True)
        for pid in map(int, ps.stdout.split()):
            os.kill(pid, signal.SIGKILL)

    def signal_node1_agent(self, sig: signal.Signals) -> None:
        """Send ``sig`` to node 1's torchrun agent alone (as a scheduler stopping that node would)."""
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True)  # whole lines
        agents = [int(line.split()[0]) for line in ps.stdout.splitlines()
                  if "torch.distributed.run" in line and f"--master-port {self.port}" in line
                  and "--node-rank 1" in line and "unshare" not in line and "bash" not in line]
        assert len(agents) == 1, [line for line in ps.stdout.splitlines() if "node-rank" in line]
        os.kill(agents[0], sig)

    def kill_node0(self) -> None:
        """SIGKILL node 0's torchrun agent and every rank it started (each rank has a session of its own)."""
        for pid in [self.procs[0].pid, *self.rank_pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.procs[1].poll() is None:
            self.kill_node1()
        self.kill_node0()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        # A node killed as a whole cannot unlink its step channel (the next run's start would):
        # remove what node 0's killed ranks left, so the test leaks nothing.
        for name in rtp_segments(self.rank_pids.values()):
            remove_segment(name)


def rtp_segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtp_{p}_") for p in pids)]


@pytest.fixture
def two_nodes(tmp_path):
    runs: list[TwoNodes] = []

    def start(*args: str, **kwargs: Any) -> TwoNodes:
        runs.append(TwoNodes(tmp_path, *args, **kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def config(tmp_path: Path, **overrides: object) -> Path:
    data = yaml.safe_load((REPO / "configs" / "cpu.yaml").read_text())
    data.update({"model": str(default_model_dir()), "dtype": "float32", **overrides})  # compared with HF fp32
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_two_nodes_greedy_equals_single_node_and_hf(tmp_path, two_nodes):
    model = default_model_dir()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in LENGTHS]
    lines = [{"prompt_token_ids": p, "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
             for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # A small token budget: the 90-token prompt is prefilled in chunks, next to decodes of the others.
    args = ["--config", str(config(tmp_path, max_num_batched_tokens=48, dtype="float32")),
            "--prompts-file", str(tmp_path / "in.jsonl")]
    run = two_nodes(*args)
    rcs = [run.wait(0, 240), run.wait(1, 60)]
    assert rcs == [0, 0], f"node 0:\n{run.output[0][-3000:]}\nnode 1:\n{run.output[1][-3000:]}"
    assert "NODE1 rc=0 shm=[]" in run.output[1], run.output[1][-2000:]
    two = [json.loads(x)["token_ids"] for x in (tmp_path / "out0.jsonl").read_text().splitlines()]

    torchrun("launch/generate.py", 4, *args, "--output", str(tmp_path / "single.jsonl"))
    single = [json.loads(x)["token_ids"] for x in (tmp_path / "single.jsonl").read_text().splitlines()]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert two == ref
    assert two == single


@pytest.fixture
def long_job(tmp_path):
    prompts = tmp_path / "long.jsonl"
    line = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
    prompts.write_text((json.dumps(line) + "\n") * 4)
    return ["--config", str(config(tmp_path, liveness_timeout_s=LIVENESS_S)), "--prompts-file", str(prompts)]


def _kill_node1_mid_generation(run) -> tuple[str, dict[int, int]]:
    """SIGKILL node 1 once node 0 generates; node 0 must exit non-zero within the bound, with none of its
    ranks alive and no segment left. Returns node 0's output and its ranks' pids."""
    run.wait_for(0, "generate:")
    pids = dict(run.rank_pids)
    time.sleep(1.0)
    t0 = time.monotonic()
    run.kill_node1()
    rc = run.wait(0, BOUND_S + 30)
    elapsed = time.monotonic() - t0
    out = run.output[0]
    assert rc != 0
    assert elapsed < BOUND_S, f"node 0 took {elapsed:.1f} s:\n{out[-3000:]}"
    assert not any(pid_alive(p) for p in pids.values()), "node 0 ranks outlived the run"
    assert not rtp_segments(pids.values()), "node 0 left a shared-memory segment behind"
    return out, pids


def test_losing_node1_stops_node0(two_nodes, long_job):
    out, pids = _kill_node1_mid_generation(two_nodes(*long_job))
    assert sorted(pids) == [0, 1], pids
    assert re.search(rf"rank [23] \(pid \d+ on host {NODE1}\) was lost: no heartbeat from its node", out), out[-3000:]


def test_sigterm_to_node1_alone_stops_the_run_as_a_sigterm_to_rank_0(two_nodes, long_job):
    """A scheduler that stops node 1 signals node 1's torchrun only: its ranks ask rank 0 (through the heartbeat
    relays) to stop, and the run ends as for a SIGTERM to rank 0, within seconds (node 1's ranks waited for a
    shutdown that never came, until torchrun killed them 30 s later and node 0 lost them)."""
    run = two_nodes(*long_job)
    run.wait_for(0, "generate:")
    time.sleep(1.0)
    t0 = time.monotonic()
    run.signal_node1_agent(signal.SIGTERM)
    run.wait(0, BOUND_S + 30)
    run.wait(1, 30)
    elapsed = time.monotonic() - t0
    out = run.output[0]
    assert elapsed < 10, f"the run took {elapsed:.1f} s to stop:\n{out[-3000:]}\n{run.output[1][-2000:]}"
    assert "node 1's ranks got SIGTERM: stopping the run as for a SIGTERM to rank 0" in out, out[-3000:]
    assert "was lost" not in out, out[-3000:]
    assert "NODE1 rc=" in run.output[1] and "shm=[]" in run.output[1], run.output[1][-2000:]


def test_losing_node0_stops_node1(two_nodes, long_job):
    run = two_nodes(*long_job)
    run.wait_for(0, "generate:")
    time.sleep(1.0)
    t0 = time.monotonic()
    run.kill_node0()
    rc = run.wait(1, BOUND_S + 30)  # node 1's shell ends when its torchrun does: every rank exited by itself
    elapsed = time.monotonic() - t0
    out = run.output[1]
    assert rc != 0
    assert elapsed < BOUND_S, f"node 1 took {elapsed:.1f} s:\n{out[-3000:]}"
    host = re.escape(socket.gethostname())
    assert re.search(rf"rank [01] \(pid \d+ on host {host}\) was lost: no heartbeat from its node", out), out[-3000:]
    assert re.search(r"NODE1 rc=[1-9]\d* shm=\[\]", out), out[-2000:]  # node 1's private /dev/shm is empty


# Pipeline parallelism across the two nodes: TP = 2 inside each node, stage 0 on node 0, stage 1 on node 1.
PP_ACROSS = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}


def _greedy_across_nodes_equals_hf(tmp_path, two_nodes, seed: int, lengths: list[int], config_file: Path,
                                   *extra: str):
    """Run ``lengths``' random prompts greedily on the two nodes (``extra``: more launcher flags), check both
    exit 0 with node 1's /dev/shm empty and the tokens equal HF's; returns the run."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]
    lines = [{"prompt_token_ids": p, "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
             for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = two_nodes("--config", str(config_file), *extra, "--prompts-file", str(tmp_path / "in.jsonl"))
    rcs = [run.wait(0, 240), run.wait(1, 60)]
    assert rcs == [0, 0], f"node 0:\n{run.output[0][-3000:]}\nnode 1:\n{run.output[1][-3000:]}"
    assert "NODE1 rc=0 shm=[]" in run.output[1], run.output[1][-2000:]
    got = [json.loads(x)["token_ids"] for x in (tmp_path / "out0.jsonl").read_text().splitlines()]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        assert got == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return run


def test_pipeline_across_nodes_greedy_equals_hf(tmp_path, two_nodes):
    _greedy_across_nodes_equals_hf(tmp_path, two_nodes, 12, LENGTHS,
                                   config(tmp_path, max_num_batched_tokens=48, **PP_ACROSS))


@pytest.mark.parametrize("lost", [1, 0])
def test_pipeline_across_nodes_losing_a_node_stops_the_other(tmp_path, two_nodes, lost):
    prompts = tmp_path / "long.jsonl"
    line = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
    prompts.write_text((json.dumps(line) + "\n") * 4)
    run = two_nodes("--config", str(config(tmp_path, liveness_timeout_s=LIVENESS_S, **PP_ACROSS)),
                    "--prompts-file", str(prompts))
    run.wait_for(0, "generate:")
    pids = dict(run.rank_pids)
    time.sleep(1.0)
    t0 = time.monotonic()
    run.kill_node1() if lost == 1 else run.kill_node0()
    survivor = 1 - lost
    rc = run.wait(survivor, BOUND_S + 30)
    elapsed = time.monotonic() - t0
    out = run.output[survivor]
    assert rc != 0
    assert elapsed < BOUND_S, f"node {survivor} took {elapsed:.1f} s:\n{out[-3000:]}"
    host = NODE1 if lost == 1 else re.escape(socket.gethostname())
    ranks = "[23]" if lost == 1 else "[01]"
    assert re.search(rf"rank {ranks} \(pid \d+ on host {host}\) was lost", out), out[-3000:]
    if lost == 1:
        assert not any(pid_alive(p) for p in pids.values()), "node 0 ranks outlived the run"
        assert not rtp_segments(pids.values()), "node 0 left a shared-memory segment behind"
    else:
        assert re.search(r"NODE1 rc=[1-9]\d* shm=\[\]", out), out[-2000:]  # node 1's private /dev/shm is empty


# Data parallelism across the two nodes: one replica per node.
DP_LENGTHS = [1, 90, 5, 40, 17, 64, 2]
_REPLICA_LOG = (r"\[rank{rank}\] INFO rtp\.runtime\.startup: data-parallel replica {d}: global ranks {first}\.\.{last} "
                r"on node {d}, step channel (rtp_\S+), CPU all-reduce in shared memory")


def test_data_parallel_across_nodes_generate_equals_hf(tmp_path, two_nodes):
    # DP = 2 x TP = 2: replica 0 is ranks 0..1 on node 0, replica 1 ranks 2..3 on node 1 (the cross-check agrees).
    run = _greedy_across_nodes_equals_hf(tmp_path, two_nodes, 13, DP_LENGTHS,
                                         config(tmp_path, max_num_batched_tokens=48, data_parallel_size=2),
                                         "--data-parallel-size-local", "1")
    # Each replica on its own node, with a step channel and a shared-memory all-reduce of its own there,
    # and each generated its round-robin share.
    for node, (rank, d, first, last) in enumerate([(0, 0, 0, 1), (2, 1, 2, 3)]):
        out = run.output[node]
        assert re.search(_REPLICA_LOG.format(rank=rank, d=d, first=first, last=last), out), out[-3000:]
        share = (len(DP_LENGTHS) + 1 - d) // 2
        assert f"[rank{rank}] INFO rtp.runtime.coordinator: generated {share} requests" in out, out[-3000:]
    assert "replica 1: shutdown" in run.output[1]


def test_data_parallel_across_nodes_losing_node1_stops_node0(tmp_path, two_nodes, long_job):
    # DP = 2 x TP = 2, replica 1 on node 1
    out, _ = _kill_node1_mid_generation(two_nodes(*long_job, "--data-parallel-size", "2"))
    # Rank 0 (in its share's step or waiting for replica 1's) ends with the lost rank named, not gloo's error.
    assert re.search(rf"^error: rank [23] \(pid \d+ on host {NODE1}\) was lost", out, re.M), out[-3000:]
    assert "Connection closed by peer" not in out and "failed its share" not in out, out[-3000:]


def test_a_wrong_data_parallel_size_local_fails_both_nodes_before_loading(tmp_path, two_nodes):
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "Once", "max_tokens": 2}) + "\n")
    args = ["--config", str(config(tmp_path, data_parallel_size=2)), "--data-parallel-size-local", "2",
            "--prompts-file", str(tmp_path / "one.jsonl")]
    run = two_nodes(*args, nproc=1)  # one rank per node: each node holds one replica, not 2
    rcs = [run.wait(0, 120), run.wait(1, 60)]
    for node, out in enumerate(run.output):
        assert rcs[node] != 0, out[-3000:]
        assert ("data_parallel_size_local=2 (--data-parallel-size-local) on node 0, but node 0 holds 1 replica(s): "
                "its 1 ranks / TP 1") in out, out[-3000:]
        assert "rtp.model.loader" not in out, out[-3000:]


@pytest.mark.parametrize("differs", ["settings", "checkpoint"])
def test_a_node_with_other_settings_or_weights_fails_both_nodes_before_loading(tmp_path, two_nodes, differs):
    """Each node reads its own flags and disk: node 0 with another block size, or with a copy of the checkpoint
    whose last weights differ, generated other tokens with exit code 0. Now every rank of both nodes refuses to
    start, naming the node and the setting or file."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "Once", "max_tokens": 2}) + "\n")
    args = ["--config", str(config(tmp_path)), "--prompts-file", str(tmp_path / "one.jsonl")]
    if differs == "settings":
        extra, words = ("--block-size", "32"), "node 1 (rtp-node1) runs cache.block_size=16, node 0 ("
    else:
        copy = tmp_path / "copy"
        shutil.copytree(default_model_dir(), copy)
        weights = copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x40  # the last tensor's last value
        weights.write_bytes(bytes(data))
        extra, words = ("--model", str(copy)), "is not node 0's (" + str(copy) + "): its model.safetensors differs"
    run = two_nodes(*args, node0_args=("--output", str(tmp_path / "out0.jsonl"), *extra))
    rcs = [run.wait(0, 120), run.wait(1, 60)]
    for node, out in enumerate(run.output):
        assert rcs[node] != 0 and words in out, out[-3000:]
        assert "rtp.model.loader" not in out, out[-3000:]
    assert not (tmp_path / "out0.jsonl").exists()


@pytest.mark.timeout(420)
def test_data_parallel_serving_across_nodes(tmp_path, two_nodes):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.server.test_serve_dp import complete, replica_metric
    from tests.server.test_serve_e2e import read_stream, wait_streaming

    cfg = config(tmp_path, data_parallel_size=2, cpu_kv_cache_gib=0.25, liveness_timeout_s=LIVENESS_S)
    # Node 0's steps take at least 10 ms, so that its streams (1900 tokens) are still running when node 1's loss
    # is detected (LIVENESS_S), however fast the host: each of them must end with that error, not with its text.
    run = two_nodes("--config", str(cfg), nproc=1, script="launch/serve.py", node0_args=("--port", "0"),
                    env={"RTP_TEST_STEP_DELAY": "0:1+:0.01"})
    run.wait_for(0, "serving on", timeout=240)
    url, frontend = re.search(r"serving on (http://\S+) \(1 API frontend process\(es\): pid (\d+)\)",
                              run.output[0]).groups()
    # Node 1's replica is reached over TCP (it is on another node), node 0's frontend connected with the secret.
    assert re.search(r"\[rank1\] INFO rtp\.server\.replica_sockets: replica 1: the API frontends connect over TCP "
                     r"127\.0\.0\.1:\d+", run.output[1]), run.output[1][-3000:]
    assert "refused a connection" not in run.output[1]

    # Greedy, mixed prompts all at once: pinned to replica 0, pinned to replica 1, routed.
    model = default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 40, 7, 100, 17, 64)]
    pins = [0, 1, None, 1, 0, None]
    with torch.no_grad():
        want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    before = replica_metric(url, "rtp_replica_routed_requests")
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda pp: complete(url, pp[0], MAX_TOKENS, pp[1]), zip(prompts, pins)))
    tok = AutoTokenizer.from_pretrained(model)
    for r, w in zip(responses, want):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(w)
    after = replica_metric(url, "rtp_replica_routed_requests")
    routed = [after[d] - before.get(d, 0) for d in (0, 1)]
    assert min(routed) >= 2 and sum(routed) == len(prompts), routed
    assert "rank 0 sleeps 0.010 s in step 1 and every later step" in run.output[0], run.output[0][-3000:]

    # Node 1 lost under load: half the streams run there, half on node 0.
    clients = 8
    results: list[dict] = [{} for _ in range(clients)]
    threads = [threading.Thread(target=read_stream, args=(url, {"prompt": f"Story {i}:", "max_tokens": 1900,
                                                                "ignore_eos": True, "stream": True}, results[i],
                                                          {"X-Data-Parallel-Rank": str(i % 2)}))
               for i in range(clients)]
    for t in threads:
        t.start()
    wait_streaming(results, clients, 60, "the requests")
    pids = dict(run.rank_pids)
    assert sorted(pids) == [0], pids
    t0 = time.monotonic()
    run.kill_node1()
    for t in threads:
        t.join(max(0.0, t0 + BOUND_S + 20 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), run.output[0][-4000:]
    rc = run.wait(0, BOUND_S + 30)
    elapsed = time.monotonic() - t0
    out = run.output[0]
    for i, r in enumerate(results):  # every stream ended with an error event naming node 1's rank and host
        assert r["error"] and "rank 1 (pid" in str(r["error"]) and NODE1 in str(r["error"]), (i, r, out[-3000:])
    assert rc != 0
    assert elapsed < BOUND_S, f"node 0 took {elapsed:.1f} s:\n{out[-3000:]}"
    assert not any(pid_alive(p) for p in [*pids.values(), int(frontend)]), "node 0 processes outlived the run"
    assert not rtp_segments(pids.values()), "node 0 left a shared-memory segment behind"
