"""Config keys as vLLM-spelled flags: parsing, YAML overrides, one-line errors naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rtp.config import RtpConfig, setting_keys
from rtp.entrypoints import serve
from rtp.entrypoints.flags import ENGINE_FLAGS, SERVER_FLAGS, load_config_from_args
from rtp.errors import ConfigError
from tests.utils import REPO


def config_of(argv: list[str]) -> RtpConfig:
    return load_config_from_args(serve.parse_args(argv), ENGINE_FLAGS + SERVER_FLAGS)


def test_every_config_key_has_a_flag():
    keys = {f.key for f in ENGINE_FLAGS + SERVER_FLAGS}
    # the model is --model or the positional MODEL; speculative_config is one JSON flag for its section
    spec = {k for k in setting_keys() if k.startswith("speculative_config.")}
    assert keys == set(setting_keys()) - {"model.path"} - spec | {"speculative_config"}


def test_flags_override_the_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: 8\nblock_size: 16\nenable_prefix_caching: true\nserver:\n  port: 1234\n")
    c = config_of(["/models/x", "--config", str(cfg), "--max-num-seqs", "32", "-tp", "2", "--dtype", "half",
                   "--no-enable-prefix-caching", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                   "--seed", "7", "--max-num-batched-tokens", "1024", "--shutdown-timeout", "3", "--enforce-eager"])
    m, sched = c.model, c.scheduler
    assert (m.path, sched.max_num_seqs, c.parallel.tensor_parallel_size, m.dtype, c.cache.enable_prefix_caching,
            m.max_model_len, c.cache.gpu_memory_utilization, m.seed, sched.max_num_batched_tokens,
            m.enforce_eager) == ("/models/x", 32, 2, "float16", False, 512, 0.5, 7, 1024, True)
    assert c.cache.block_size == 16 and c.server.port == 1234 and c.server.shutdown_grace_s == 3.0  # the YAML's, kept
    assert config_of(["--config", str(cfg)]).scheduler.max_num_seqs == 8


def test_kv_cache_dtype_flag_takes_vllm_spellings():
    assert config_of([]).cache.kv_cache_dtype == "auto"
    assert config_of(["--kv-cache-dtype", "fp8_e4m3"]).cache.kv_cache_dtype == "fp8_e4m3"
    assert config_of(["--kv-cache-dtype", "fp8"]).cache.kv_cache_dtype == "fp8_e4m3"  # vLLM's alias of e4m3


def test_generation_config_flag_takes_vllms_spelling():
    assert config_of([]).model.generation_config == "auto"
    assert config_of(["--generation-config", "none"]).model.generation_config == "none"
    assert config_of(["--generation-config", "vllm"]).model.generation_config == "none"  # vLLM: its own defaults


def test_api_server_count_and_its_alias():
    assert config_of([]).server.api_processes is None  # chosen by the core count at start
    assert config_of(["--api-server-count", "2"]).server.api_processes == 2
    assert config_of(["--api-processes", "0"]).server.api_processes == 0


def test_positional_model_and_model_flag():
    assert serve.parse_args(["/m"]).model == "/m"
    assert serve.parse_args(["--model", "/m"]).model == "/m"
    assert serve.parse_args(["/m", "--model", "/m/"]).model == "/m"
    with pytest.raises(SystemExit):
        serve.parse_args(["/a", "--model", "/b"])


@pytest.mark.parametrize(("argv", "words"), [
    (["--max-num-seqs", "0"], "--max-num-seqs=0 is invalid: expected an integer >= 1"),
    (["--block-size", "48"], "--block-size=48 is invalid: expected a power of two"),
    (["--dtype", "float64"], "--dtype=float64 is invalid: expected one of auto, float32"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5 is invalid"),
    (["--port", "70000"], "--port=70000 is invalid"),
    (["--api-server-count", "65"], "--api-server-count=65 is invalid"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype=fp8_e5m2 is invalid: expected one of auto, fp8_e4m3"),
])
def test_bad_values_name_the_flag(argv, words):
    with pytest.raises(ConfigError, match="^" + words.replace(".", r"\.").replace("(", r"\(")):
        config_of(argv)


def test_rtp_serve_bad_flags_fail_in_one_line_before_any_rank_starts(tmp_path):
    env_cmd = [sys.executable, "-m", "rtp.launcher", "serve"]
    for argv, rc, words in ((["--max-num-seqs", "0"], 1, "--max-num-seqs=0 is invalid"),
                            (["--max-num-seqs", "x"], 2, "argument --max-num-seqs: invalid int value: 'x'"),
                            (["--tensor-parallel-size", "2", "--nproc-per-node", "3"], 1, "disagree"),
                            (["--no-such-flag"], 2, "unrecognized arguments")):
        proc = subprocess.run([*env_cmd, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == rc and len(lines) == 1 and words in lines[0], (argv, proc.stderr)


def test_tensor_parallel_size_sets_the_rank_count():
    from rtp.launcher import plan_launch

    args = serve.parse_args(["--tensor-parallel-size", "2"])
    args.nproc_per_node = None
    assert plan_launch("rtp.entrypoints.serve", args).nproc == 2
    args = serve.parse_args([])
    args.nproc_per_node = None
    assert plan_launch("rtp.entrypoints.serve", args).nproc == 1  # cpu.yaml leaves tensor_parallel_size null


def test_the_launchers_shutdown_timeout_covers_the_servers_grace():
    """torchrun kills the ranks that outlive its shutdown timeout after a SIGTERM (torch's default: 30 s): `rtp
    serve` sets it past the grace, so a --shutdown-timeout of 60 s lets running requests finish."""
    from rtp.launcher import plan_launch

    args = serve.parse_args(["--shutdown-timeout", "60"])
    args.nproc_per_node = None
    assert plan_launch("rtp.entrypoints.serve", args).shutdown_timeout_s > 60 + 35  # the engine loop's margins


def test_pipeline_parallel_size_multiplies_the_rank_count():
    from rtp.errors import RtpError
    from rtp.launcher import plan_launch

    args = serve.parse_args(["-tp", "2", "--pipeline-parallel-size", "2", "--pipeline-layer-partition", "1,1"])
    args.nproc_per_node = None
    assert plan_launch("rtp.entrypoints.serve", args).nproc == 4
    assert config_of(["-pp", "2", "--pipeline-layer-partition", "3,1"]).parallel.pipeline_layer_partition == (3, 1)
    args.nproc_per_node = 2
    with pytest.raises(RtpError, match="--nproc-per-node 2 and --tensor-parallel-size 2 x --pipeline-parallel-size 2"):
        plan_launch("rtp.entrypoints.serve", args)


def test_speculative_config_flag_is_json_and_its_errors_name_the_key():
    c = config_of(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert (c.speculative_config.method, c.speculative_config.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ConfigError, match=r"^--speculative-config: speculative_config\.num_speculative_tokens=0 "):
        config_of(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    with pytest.raises(SystemExit):
        config_of(["--speculative-config", "{method: ngram}"])  # not JSON: argparse's one-line error


def test_data_parallel_size_local_flag_is_a_cross_check():
    from rtp.errors import RtpError
    from rtp.launcher import plan_launch

    assert config_of(["-dp", "4", "--data-parallel-size-local", "2"]).parallel.data_parallel_size_local == 2
    assert config_of(["-dp", "4", "-dpl", "1"]).parallel.data_parallel_size_local == 1
    with pytest.raises(ConfigError, match="data_parallel_size_local.*at most.*2"):
        config_of(["-dp", "2", "--data-parallel-size-local", "3"])
    args = serve.parse_args(["-dp", "2", "-dpl", "2"])
    args.nproc_per_node = None
    assert plan_launch("rtp.entrypoints.serve", args).nproc == 2
    args = serve.parse_args(["-dp", "2", "-dpl", "1"])  # `rtp serve` is one node: it holds both replicas
    args.nproc_per_node = None
    with pytest.raises(RtpError, match="--data-parallel-size-local 1 and --data-parallel-size 2 disagree"):
        plan_launch("rtp.entrypoints.serve", args)


def test_the_configs_tensor_parallel_size_is_checked_against_the_rank_count(tmp_path):
    from rtp.errors import RtpError
    from rtp.launcher import plan_launch

    cfg = tmp_path / "tp2.yaml"
    cfg.write_text("tensor_parallel_size: 2\n")
    args = serve.parse_args(["--config", str(cfg)])
    args.nproc_per_node = 1  # the ranks started, loaded the model, then refused the world size
    with pytest.raises(RtpError, match="--nproc-per-node 1 and the config's tensor_parallel_size 2 disagree"):
        plan_launch("rtp.entrypoints.serve", args)
    args.nproc_per_node = 2
    assert plan_launch("rtp.entrypoints.serve", args).nproc == 2


def test_log_level_takes_any_case():
    assert config_of(["--log-level", "debug"]).log_level == "DEBUG"  # as YAML and rtp.init() take it


def test_prompts_file_lines_are_checked_with_the_values_the_run_uses(tmp_path):
    from rtp.entrypoints.generate import read_requests
    from rtp.errors import RtpError

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a", "min_tokens": 20}\n{"prompt": "b", "logit_bias": {"5": 3, "7": -1}}\n')
    # min_tokens 20 fits --max-tokens 40, and a max_tokens left out (the model's default) is not known yet.
    _, items, linenos = read_requests(str(path), max_tokens=40)
    assert items[0]["max_tokens"] == 40 and items[1]["logit_bias"] == {5: 3, 7: -1} and linenos == [1, 2]
    read_requests(str(path))
    with pytest.raises(RtpError, match=r"in\.jsonl:1: .*min_tokens=20 .* max_tokens=5"):
        read_requests(str(path), max_tokens=5)
    path.write_text('{"prompt": "b", "logit_bias": {"x": 3}}\n')  # JSON keys that are no token id stay refused
    with pytest.raises(RtpError, match=r"in\.jsonl:1: .*logit_bias"):
        read_requests(str(path))


def test_a_tp_size_that_does_not_split_the_heads_fails_before_any_rank_starts(tmp_path):
    from rtp.errors import ModelShapeError
    from rtp.launcher import plan_launch
    from rtp.testing import TinyQwen3Spec, make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "m", TinyQwen3Spec(num_attention_heads=4, num_key_value_heads=2))
    for argv, nproc, words in ((["-tp", "3"], None, "num_attention_heads=4"),
                               (["-tp", "4"], None, None),  # KV heads replicated: fine
                               (["-pp", "2", "--pipeline-layer-partition", "1,1"], 6, "num_attention_heads=4")):
        args = serve.parse_args(["--model", str(model), *argv])
        args.nproc_per_node = nproc
        if words is None:
            plan_launch("rtp.entrypoints.serve", args)
            continue
        with pytest.raises(ModelShapeError, match=words):  # the ranks said so ~9 s later, after loading torch
            plan_launch("rtp.entrypoints.serve", args)
