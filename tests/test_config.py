"""Tests of rtp.config: shipped YAML files, validation messages, overrides, TP size."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest
import yaml

from rtp import config as config_module
from rtp.config import (
    CacheConfig,
    LivenessConfig,
    ModelConfig,
    ParallelConfig,
    RtpConfig,
    SchedulerConfig,
    ServerConfig,
    config_from_dict,
    default_config_path,
    load_config,
    resolve_tp_size,
    value_of,
)
from rtp.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))
GPU_FILES = ["1xH100", "2xH100", "4xH100", "8xH100", "1xH200", "8xH200"]


def write(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- shipped files


def test_every_expected_topology_is_shipped() -> None:
    names = {p.stem for p in SHIPPED}
    assert {"cpu", *GPU_FILES} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_yaml_loads_and_round_trips(path: Path) -> None:
    config = load_config(path)
    # Every key the file writes ends up in the config unchanged.
    raw = yaml.safe_load(path.read_text())
    for key, value in raw.items():
        if key == "server":
            for sub_key, sub_value in value.items():
                assert getattr(config.server, sub_key) == sub_value, f"server.{sub_key}"
        else:
            assert value_of(config, key) == value, key
    assert config_from_dict(dataclasses.asdict(config)) == config
    # A prefill step's token ids and slot mapping (int64 each) fit one ring chunk (null: at most 8192 tokens).
    assert config.parallel.shm_chunk_bytes >= 16 * (config.scheduler.max_num_batched_tokens or 8192)
    assert config.model.path is None  # users pass --model


@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_topology_files(name: str) -> None:
    config = load_config(CONFIG_DIR / f"{name}.yaml")
    parallel, cache, scheduler = config.parallel, config.cache, config.scheduler
    assert parallel.tensor_parallel_size == int(name.split("x")[0])
    assert resolve_tp_size(config, parallel.tensor_parallel_size) == parallel.tensor_parallel_size
    assert parallel.device == "cuda" and config.model.dtype == "bfloat16"
    assert cache.block_size % 256 == 0  # flash-attn's paged KV layout
    assert not config.model.enforce_eager
    assert 0.8 <= cache.gpu_memory_utilization <= 0.95
    assert 256 <= scheduler.max_num_seqs <= 512
    assert 8192 <= scheduler.max_num_batched_tokens <= 16384
    assert config.model.cuda_graph_max_batch <= scheduler.max_num_seqs
    assert scheduler.max_num_batched_tokens >= scheduler.max_num_seqs  # a full decode batch fits one step


@pytest.mark.parametrize(("name", "tp", "ep", "kv"), [("1xH200-qwen3-30b-a3b-fp8", 1, False, "fp8_e4m3"),
                                                      ("8xH100-qwen3-235b-a22b-fp8", 8, True, "fp8_e4m3"),
                                                      ("1xH100-qwen3-8b-awq", 1, False, "auto")])
def test_quantized_checkpoint_files(name: str, tp: int, ep: bool, kv: str) -> None:
    config = load_config(CONFIG_DIR / f"{name}.yaml")
    assert (config.parallel.tensor_parallel_size, config.parallel.expert_parallel, config.cache.kv_cache_dtype) == (
        tp, ep, kv)
    assert config.parallel.device == "cuda" and config.model.dtype == "bfloat16" and not config.model.enforce_eager
    assert config.model.path is None  # the checkpoint is given with --model, as in the other GPU files
    assert config.model.quantization is None  # a quantized checkpoint's format comes from its quantization_config
    block = config.cache.block_size
    assert block is not None and (kv == "fp8_e4m3" or block % 256 == 0)  # fp8: Triton, any size; else flash-attn


def test_cpu_file_is_the_default_and_fits_any_rank_count() -> None:
    path = default_config_path()
    assert path is not None and path.resolve() == (CONFIG_DIR / "cpu.yaml").resolve()
    config = load_config(path)
    assert config.parallel.tensor_parallel_size is None
    for world_size in (1, 2, 3, 4):
        assert resolve_tp_size(config, world_size) == world_size
    assert config.parallel.device == "cpu" and config.model.dtype == "auto" and config.model.enforce_eager
    assert config.cache.cpu_kv_cache_gib == 0.5 and config.cache.block_size == 16


def test_no_path_gives_dataclass_defaults() -> None:
    assert load_config() == RtpConfig()
    assert load_config(None).server == ServerConfig()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "# only a comment\n")) == RtpConfig()


# --------------------------------------------------------------------------- bad values

# (id, YAML text, key the message must name, texts the message must contain)
BAD_CONFIGS: list[tuple[str, str, str, list[str]]] = [
    ("typo", "blok_size: 16", "blok_size", ["did you mean 'block_size'", "allowed keys", "max_num_seqs"]),
    ("unknown", "flux_capacitor: 1", "flux_capacitor", ["allowed keys", "tensor_parallel_size"]),
    ("unknown-server", "server:\n  prot: 80", "server.prot", ["did you mean 'server.port'", "host"]),
    ("server-key-at-top", "port: 8000", "port", ["server.port", "allowed keys"]),
    ("top-key-in-server", "server:\n  block_size: 16", "server.block_size", ["did you mean 'block_size'"]),
    ("bool-for-int", "block_size: true", "block_size=True", ["power of two between 1 and 1024", "boolean"]),
    ("yes-for-int", "max_num_seqs: yes", "max_num_seqs=True", [">= 1"]),
    ("float-for-int", "max_num_batched_tokens: 8192.0", "max_num_batched_tokens=8192.0", [">= 1"]),
    ("str-for-float", 'gpu_memory_utilization: "0.9"', "gpu_memory_utilization='0.9'", ["(0, 1]", "string"]),
    ("bool-for-float", "liveness_timeout_s: true", "liveness_timeout_s=True", ["(0, 3600]"]),
    ("str-for-int", 'server:\n  port: "8000"', "server.port='8000'", ["[0, 65535]", "string"]),
    ("str-for-bool", 'enforce_eager: "false"', "enforce_eager='false'", ["true or false"]),
    ("int-for-bool", "enable_prefix_caching: 1", "enable_prefix_caching=1", ["true or false"]),
    ("str-for-bool-ep", "expert_parallel: yes-please", "expert_parallel='yes-please'", ["true or false"]),
    ("int-for-str", "model: 123", "model=123", ["path", "null"]),
    ("empty-model", 'model: ""', "model=''", ["path"]),
    ("block-negative", "block_size: -3", "block_size=-3", ["power of two between 1 and 1024"]),
    ("block-not-pow2", "block_size: 24", "block_size=24", ["power of two between 1 and 1024"]),
    ("block-too-big", "block_size: 2048", "block_size=2048", ["power of two between 1 and 1024"]),
    ("tp-zero", "tensor_parallel_size: 0", "tensor_parallel_size=0", [">= 1", "null"]),
    ("seqs-zero", "max_num_seqs: 0", "max_num_seqs=0", [">= 1"]),
    ("tokens-negative", "max_num_batched_tokens: -1", "max_num_batched_tokens=-1", [">= 1"]),
    ("model-len-zero", "max_model_len: 0", "max_model_len=0", [">= 1", "null"]),
    ("kv-blocks-zero", "num_kv_blocks: 0", "num_kv_blocks=0", [">= 1"]),
    ("graph-batch-zero", "cuda_graph_max_batch: 0", "cuda_graph_max_batch=0", [">= 1"]),
    ("gpu-util-zero", "gpu_memory_utilization: 0", "gpu_memory_utilization=0.0", ["(0, 1]"]),
    ("gpu-util-high", "gpu_memory_utilization: 1.5", "gpu_memory_utilization=1.5", ["(0, 1]"]),
    ("cpu-kv-zero", "cpu_kv_cache_gib: 0", "cpu_kv_cache_gib=0.0", ["> 0"]),
    ("cpu-kv-inf", "cpu_kv_cache_gib: .inf", "cpu_kv_cache_gib=inf", ["> 0"]),
    ("kv-dtype-e5m2", "kv_cache_dtype: fp8_e5m2", "kv_cache_dtype='fp8_e5m2'", ["one of auto, fp8_e4m3"]),
    ("kv-dtype-cache", "cache:\n  kv_cache_dtype: int8", "kv_cache_dtype='int8'", ["one of auto, fp8_e4m3"]),
    ("liveness-zero", "liveness_timeout_s: 0", "liveness_timeout_s=0.0", ["(0, 3600]"]),
    ("liveness-high", "liveness_timeout_s: 3601", "liveness_timeout_s=3601.0", ["(0, 3600]"]),
    ("liveness-nan", "liveness_timeout_s: .nan", "liveness_timeout_s=nan", ["(0, 3600]"]),
    ("step-timeout-zero", "step_timeout_s: 0", "step_timeout_s=0.0", ["(0, 86400]", "null"]),
    ("step-timeout-high", "step_timeout_s: 86401", "step_timeout_s=86401.0", ["(0, 86400]"]),
    ("step-timeout-str", 'step_timeout_s: "5m"', "step_timeout_s='5m'", ["(0, 86400]", "string"]),
    ("shm-chunk-small", "shm_chunk_bytes: 1024", "shm_chunk_bytes=1024", [">= 4096"]),
    ("shm-chunks-one", "shm_num_chunks: 1", "shm_num_chunks=1", [">= 2"]),
    ("seed-negative", "seed: -1", "seed=-1", ["[0, "]),
    ("port-high", "server:\n  port: 70000", "server.port=70000", ["[0, 65535]"]),
    ("body-zero", "server:\n  max_request_bytes: 0", "server.max_request_bytes=0", [">= 1"]),
    ("grace-negative", "server:\n  shutdown_grace_s: -1", "server.shutdown_grace_s=-1.0", ["[0, "]),
    ("empty-api-key", 'server:\n  api_key: ""', "server.api_key=''", ["non-empty string"]),
    ("int-host", "server:\n  host: 0", "server.host=0", ["host name or IP address"]),
    ("server-not-mapping", "server: 5", "server=5", ["mapping", "max_tokens_limit"]),
    ("device", "device: tpu", "device='tpu'", ["auto", "cpu", "cuda"]),
    ("dtype", "dtype: f16", "dtype='f16'", ["float32", "bfloat16", "float16"]),
    ("log-level", "log_level: VERBOSE", "log_level='VERBOSE'", ["DEBUG", "INFO", "WARNING", "ERROR"]),
    (
        "default-over-limit",
        "server:\n  max_tokens_limit: 100\n  default_max_tokens: 200",
        "server.default_max_tokens=200",
        ["server.max_tokens_limit=100"],
    ),
]


@pytest.mark.parametrize(
    ("text", "key", "expected"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_is_reported_on_one_line(tmp_path: Path, text: str, key: str, expected: list[str]) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")  # names the source file
    assert key in message
    for text_part in expected:
        assert text_part in message
    # The same mapping given as a dict is rejected the same way, naming the dict's source.
    with pytest.raises(ConfigError, match="^mine: "):
        config_from_dict(yaml.safe_load(text), source="mine")


# (id, file content or None for a missing file, texts the message must contain)
BAD_FILES: list[tuple[str, str | None, list[str]]] = [
    ("list", "- block_size\n- 16\n", ["top level must be a mapping", "a list", "allowed keys"]),
    ("scalar", "just some words\n", ["top level must be a mapping", "a string"]),
    ("syntax", "block_size: [16, 32\nseed: 0\n", ["invalid YAML at line"]),
    ("bad-indent", "server:\n  port: 1\n host: x\n", ["invalid YAML at line 3"]),
    ("duplicate", "block_size: 16\nblock_size: 32\n", ["duplicate key 'block_size'", "line 2"]),
    ("missing", None, ["config file not found", "cpu.yaml"]),
]


@pytest.mark.parametrize(("content", "expected"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_file_is_reported_on_one_line(tmp_path: Path, content: str | None, expected: list[str]) -> None:
    path = tmp_path / "x.yaml" if content is None else write(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    for text_part in expected:
        assert text_part in message


def test_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"^CacheConfig: block_size=3 is invalid"):
        CacheConfig(block_size=3)
    with pytest.raises(ConfigError, match=r"^RtpConfig: cache\.block_size=3 is invalid"):
        RtpConfig(cache={"block_size": 3})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^RtpConfig: server\.port=-1 is invalid"):
        RtpConfig(server={"port": -1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^ServerConfig: default_max_tokens=9 is invalid"):
        ServerConfig(max_tokens_limit=8, default_max_tokens=9)
    config = RtpConfig(server={"port": 0})  # type: ignore[arg-type]
    assert isinstance(config.server, ServerConfig) and config.server.port == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 32  # type: ignore[misc]


def test_normalisation(tmp_path: Path) -> None:
    text = "gpu_memory_utilization: 1\nlog_level: debug\nliveness_timeout_s: 5\n"
    config = load_config(write(tmp_path, text))
    assert config.cache.gpu_memory_utilization == 1.0 and isinstance(config.cache.gpu_memory_utilization, float)
    assert isinstance(config.liveness.timeout_s, float)
    assert config.log_level == "DEBUG"
    assert load_config(model=tmp_path).model.path == str(tmp_path)  # a PathLike becomes a str


@pytest.mark.parametrize(("key", "alias", "stored"), [
    ("dtype", "half", "float16"), ("dtype", "fp16", "float16"), ("dtype", "bf16", "bfloat16"),
    ("dtype", "float", "float32"), ("dtype", "fp32", "float32"),
    ("kv_cache_dtype", "fp8", "fp8_e4m3"), ("generation_config", "vllm", "none")])
def test_vllm_spellings_are_taken_from_yaml_and_keyword_overrides(tmp_path: Path, key: str, alias: str,
                                                                    stored: str) -> None:
    section = "cache" if key == "kv_cache_dtype" else "model"
    for config in (load_config(write(tmp_path, f"{key}: {alias}\n")), load_config(**{key: alias})):
        assert getattr(getattr(config, section), key) == stored
    with pytest.raises(ConfigError, match=f"{key}='{alias.upper()}' is invalid"):
        load_config(**{key: alias.upper()})  # aliases are exact spellings, like the choices


def test_liveness_defaults_catch_a_hung_rank_within_ten_seconds_on_cpu() -> None:
    cpu = load_config(CONFIG_DIR / "cpu.yaml")
    # Caught once the heartbeat is this old, plus a watchdog round and the exit (about a second).
    assert cpu.liveness.timeout_s <= 9
    assert cpu.liveness.step_timeout_s is not None and cpu.liveness.step_timeout_s >= 60  # a long CPU prefill
    for name in GPU_FILES:
        gpu = load_config(CONFIG_DIR / f"{name}.yaml").liveness
        # Generous on GPU (a C call holding the GIL starves the heartbeat), and a step gets minutes.
        assert 10 <= gpu.timeout_s <= 60 and gpu.step_timeout_s >= 120, name
    # null: no stuck-step check
    assert config_from_dict({"step_timeout_s": None}).liveness.step_timeout_s is None
    assert RtpConfig().liveness.timeout_s <= 10


def test_api_key_is_not_in_repr() -> None:
    config = RtpConfig(server=ServerConfig(api_key="s3cret-value"))
    assert config.server.api_key == "s3cret-value"
    assert "s3cret-value" not in repr(config)


SECTIONS = (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig, LivenessConfig, ServerConfig)


def test_every_field_has_a_rule_and_a_docstring() -> None:
    for cls in (RtpConfig, *SECTIONS):
        names = [f.name for f in dataclasses.fields(cls)]
        assert all("rule" in f.metadata or "section" in f.metadata for f in dataclasses.fields(cls)), cls
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
        documented = {
            stmt.target.id
            for stmt, nxt in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
            and nxt.value.value.strip()
        }
        assert documented == set(names), set(names) - documented


# --------------------------------------------------------------------------- overrides


def test_none_overrides_are_ignored() -> None:
    path = CONFIG_DIR / "cpu.yaml"
    plain = load_config(path)
    assert load_config(path, block_size=None, model=None, server={"port": None, "api_key": None}) == plain
    assert load_config(path, server=None) == plain


def test_override_beats_yaml_and_server_mappings_merge(tmp_path: Path) -> None:
    text = "block_size: 16\nmax_num_seqs: 8\nserver:\n  host: 0.0.0.0\n  port: 9000\n"
    path = write(tmp_path, text, "ok.yaml")
    config = load_config(path, block_size=32, server={"port": 0})
    assert config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 8  # not overridden: the file's value
    assert config.server.port == 0
    assert config.server.host == "0.0.0.0"  # the file's server mapping is merged, not replaced


def test_override_replaces_a_bad_file_value(tmp_path: Path) -> None:
    path = write(tmp_path, "block_size: 3\n")
    assert load_config(path, block_size=64).cache.block_size == 64


def test_bad_override_names_override_as_source(tmp_path: Path) -> None:
    path = write(tmp_path, "block_size: 16\n", "ok.yaml")
    with pytest.raises(ConfigError, match=r"^override: block_size=3 is invalid: expected a power of two"):
        load_config(path, block_size=3)
    with pytest.raises(ConfigError, match=r"^override: server\.port='x' is invalid"):
        load_config(path, server={"port": "x"})
    with pytest.raises(ConfigError, match=r"^override: unknown key 'blok_size' \(did you mean 'block_size'"):
        load_config(path, blok_size=32)
    with pytest.raises(ConfigError, match=r"^override: server=3 is invalid"):
        load_config(path, server=3)
    # A bad value that stays in the file is still blamed on the file.
    bad = write(tmp_path, "seed: -5\n")
    with pytest.raises(ConfigError, match=f"^{bad}: seed=-5"):
        load_config(bad, block_size=32)


# --------------------------------------------------------------------------- tensor-parallel size


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_tp_size_none_follows_world_size(world_size: int) -> None:
    assert resolve_tp_size(RtpConfig(), world_size) == world_size


def test_tp_size_mismatch_names_both_numbers() -> None:
    config = RtpConfig(parallel=ParallelConfig(tensor_parallel_size=4))
    assert resolve_tp_size(config, 4) == 4
    with pytest.raises(ConfigError) as info:
        resolve_tp_size(config, 2)
    message = str(info.value)
    assert "\n" not in message
    assert "tensor_parallel_size=4" in message and "2 ranks" in message
    assert "torchrun --nproc-per-node 4" in message


def test_data_parallel_size_splits_the_world() -> None:
    assert resolve_tp_size(RtpConfig(parallel=ParallelConfig(data_parallel_size=2)), 4) == 2
    config = RtpConfig(parallel=ParallelConfig(data_parallel_size=2, tensor_parallel_size=2))
    assert resolve_tp_size(config, 4) == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 x data_parallel_size 2.*nproc-per-node 4"):
        resolve_tp_size(config, 2)
    both = RtpConfig(parallel=ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 with data_parallel_size=2 is not supported"):
        resolve_tp_size(both, 4)
    with pytest.raises(ConfigError, match="data_parallel_size=2 does not divide the 3 ranks"):
        resolve_tp_size(RtpConfig(parallel=ParallelConfig(data_parallel_size=2)), 3)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        load_config(None, data_parallel_size=0)


def test_data_parallel_size_local_key(tmp_path: Path) -> None:
    assert load_config(None).parallel.data_parallel_size_local is None  # derived from the node's ranks at start
    path = tmp_path / "dp.yaml"
    path.write_text("data_parallel_size: 4\nparallel:\n  data_parallel_size_local: 2\n")
    assert load_config(path).parallel.data_parallel_size_local == 2
    path.write_text("data_parallel_size: 2\ndata_parallel_size_local: 3\n")  # the flat spelling
    with pytest.raises(ConfigError, match=r"data_parallel_size_local.*at most data_parallel_size=2"):
        load_config(path)
    with pytest.raises(ConfigError, match="data_parallel_size_local"):
        load_config(None, data_parallel_size_local=0)


@pytest.mark.parametrize("world_size", [0, -1, True])
def test_tp_size_rejects_bad_world_size(world_size: int) -> None:
    with pytest.raises(ConfigError, match="world size"):
        resolve_tp_size(RtpConfig(), world_size)


# --------------------------------------------------------------------------- sections


SECTIONED_CPU = """
model:
  path: null
  dtype: auto
  enforce_eager: true
  seed: 0
parallel:
  tensor_parallel_size: null
  device: cpu
  shm_chunk_bytes: 1048576
  shm_num_chunks: 4
cache:
  block_size: 16
  enable_prefix_caching: true
  cpu_kv_cache_gib: 0.5
scheduler:
  max_num_seqs: 256
  max_num_batched_tokens: null
liveness:
  timeout_s: 8
  step_timeout_s: 300
log_level: INFO
server:
  host: 127.0.0.1
  port: 8000
  api_key: null
  max_tokens_limit: 4096
  default_max_tokens: 256
"""


def test_sectioned_file_equals_the_flat_one(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, SECTIONED_CPU, "s.yaml")) == load_config(CONFIG_DIR / "cpu.yaml")


def test_flat_keys_map_to_one_field_each() -> None:
    keys = config_module.flat_keys()
    assert len(set(keys.values())) == len(keys)
    assert keys["block_size"] == "cache.block_size" and keys["model"] == "model.path"
    assert keys["liveness_timeout_s"] == "liveness.timeout_s"
    assert not any(v.startswith("server.") for v in keys.values())  # server settings were never flat
    config = config_from_dict({"max_num_seqs": 3, "parallel": {"device": "cpu"}, "model": "/m"})
    assert value_of(config, "max_num_seqs") == value_of(config, "scheduler.max_num_seqs") == 3
    assert config.parallel.device == "cpu" and config.model.path == "/m"


def test_model_is_a_path_or_a_section() -> None:
    assert config_from_dict({"model": "/m"}).model == ModelConfig(path="/m")
    assert config_from_dict({"model": {"path": "/m", "dtype": "float32"}}).model == ModelConfig("/m", "float32")
    assert config_from_dict({"model": None}).model == ModelConfig()


# (id, YAML text, texts the message must contain)
BAD_SECTIONED: list[tuple[str, str, list[str]]] = [
    ("bad-value", "cache:\n  block_size: 24", ["cache.block_size=24 is invalid", "power of two"]),
    ("bad-type", "scheduler:\n  max_num_seqs: x", ["scheduler.max_num_seqs='x' is invalid", ">= 1", "string"]),
    ("renamed", "liveness:\n  liveness_timeout_s: 5",
     ["'liveness.liveness_timeout_s' was renamed to 'liveness.timeout_s'", "top-level 'liveness_timeout_s'"]),
    ("renamed-model", "model:\n  model: /m", ["'model.model' was renamed to 'model.path'"]),
    ("wrong-section", "cache:\n  max_num_seqs: 4",
     ["unknown key 'cache.max_num_seqs'", "'scheduler.max_num_seqs'", "allowed keys under cache: block_size"]),
    ("typo", "cache:\n  blok_size: 4", ["did you mean 'cache.block_size'"]),
    ("not-a-mapping", "cache: 16", ["cache=16 is invalid", "mapping", "block_size"]),
    ("twice", "block_size: 16\ncache:\n  block_size: 32", ["block_size and cache.block_size both set"]),
    ("section-field-at-top", "timeout_s: 5", ["did you mean 'liveness.timeout_s'", "allowed keys"]),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD_SECTIONED], ids=[c[0] for c in BAD_SECTIONED])
def test_bad_sectioned_config_is_reported_on_one_line(tmp_path: Path, text: str, expected: list[str]) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    for text_part in expected:
        assert text_part in message, message


def test_section_overrides_merge_setting_by_setting(tmp_path: Path) -> None:
    path = write(tmp_path, "cache:\n  block_size: 16\n  num_kv_blocks: 9\nmodel: /m\n", "ok.yaml")
    config = load_config(path, cache={"block_size": 32, "num_kv_blocks": None}, model={"dtype": "float32"})
    assert config.cache.block_size == 32 and config.cache.num_kv_blocks == 9  # None: not overridden
    assert config.model.path == "/m" and config.model.dtype == "float32"
    assert load_config(path, block_size=64).cache.block_size == 64  # a flat override beats the file's section
    with pytest.raises(ConfigError, match=r"^override: cache\.block_size=3 is invalid"):
        load_config(path, cache={"block_size": 3})


def test_replace_settings_keeps_what_is_not_overridden() -> None:
    base = RtpConfig(model=ModelConfig(path="/m", dtype="float32"),
                     liveness=LivenessConfig(step_timeout_s=None))
    config = config_module.replace_settings(base, block_size=32, model="/other")
    assert config.model == ModelConfig(path="/other", dtype="float32")
    assert config.cache.block_size == 32 and config.liveness.step_timeout_s is None
    with pytest.raises(ConfigError, match=r"^override: max_num_seqs=0 is invalid"):
        config_module.replace_settings(base, max_num_seqs=0)


@pytest.mark.parametrize(("spec", "words"), [
    ("{method: eagle3, num_speculative_tokens: 3}", "model=None is invalid: expected a draft checkpoint folder path "
     "with speculative_config.method='eagle3'"),
    ("{method: draft_model, num_speculative_tokens: 3}", "model=None is invalid: expected a draft checkpoint "
     "folder path"),
    ("{method: medusa, num_speculative_tokens: 3}", "speculative_config.method='medusa' is invalid: expected one of "
     "ngram, draft_model, eagle3 or null"),
    ("{method: ngram, num_speculative_tokens: 0}", "speculative_config.num_speculative_tokens=0 is invalid"),
    ("{method: ngram}", "num_speculative_tokens=None is invalid: expected an integer in [1, 64] with "
     "speculative_config.method='ngram'"),
    ("{method: ngram, num_speculative_tokens: 2, prompt_lookup_min: 4, prompt_lookup_max: 3}",
     "speculative_config.prompt_lookup_max=3 is invalid: expected an integer >= "
     "speculative_config.prompt_lookup_min=4"),
    ("{method: ngram, num_speculative_tokens: 2, prompt_lookup_min: 0}", "speculative_config.prompt_lookup_min=0"),
    ("{method: ngram, num_speculative_tokens: 2, min_acceptance_rate: 1.5}", "min_acceptance_rate=1.5 is invalid"),
    ("{method: ngram, num_speculative_tokens: 2, lookahead: 3}", "unknown key 'speculative_config.lookahead'"),
    ("{num_speculative_tokens: 2}", "method=None is invalid: expected one of ngram, draft_model, "
     "eagle3 with speculative_config.num_speculative_tokens=2"),
    ("{model: /some/head}", "method=None is invalid: expected one of ngram, draft_model, eagle3 with "
     "speculative_config.model='/some/head'"),
    ("{method: ngram, num_speculative_tokens: 2, model: /some/head}", "speculative_config.model='/some/head' is "
     "invalid: expected None with speculative_config.method='ngram'"),
])
def test_speculative_config_errors_name_the_key(tmp_path: Path, spec: str, words: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"speculative_config: {spec}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_speculative_config_defaults_and_lookup_range(tmp_path: Path) -> None:
    assert not load_config(None).speculative_config.enabled
    path = tmp_path / "c.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 4\n  prompt_lookup_max: 1\n")
    spec = load_config(path).speculative_config
    assert spec.enabled and spec.num_speculative_tokens == 4 and spec.lookup_range == (1, 1)
    assert dataclasses.replace(spec, prompt_lookup_max=None).lookup_range == (2, 5)
