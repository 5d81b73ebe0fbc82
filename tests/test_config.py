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
    RtpConfig,
    ServerConfig,
    config_from_dict,
    default_config_path,
    load_config,
    resolve_tp_size,
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
            assert getattr(config, key) == value, key
    assert config_from_dict(dataclasses.asdict(config)) == config
    # A prefill step's token ids and slot mapping (int64 each) fit one ring chunk.
    assert config.shm_chunk_bytes >= 16 * config.max_num_batched_tokens
    assert config.model is None  # users pass --model


@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_topology_files(name: str) -> None:
    config = load_config(CONFIG_DIR / f"{name}.yaml")
    assert config.tensor_parallel_size == int(name.split("x")[0])
    assert resolve_tp_size(config, config.tensor_parallel_size) == config.tensor_parallel_size
    assert config.device == "cuda" and config.dtype == "bfloat16"
    assert config.block_size % 256 == 0  # flash-attn's paged KV layout
    assert not config.enforce_eager
    assert 0.8 <= config.gpu_memory_utilization <= 0.95
    assert 256 <= config.max_num_seqs <= 512
    assert 8192 <= config.max_num_batched_tokens <= 16384
    assert config.cuda_graph_max_batch <= config.max_num_seqs
    assert config.max_num_batched_tokens >= config.max_num_seqs  # a full decode batch fits one step


def test_cpu_file_is_the_default_and_fits_any_rank_count() -> None:
    path = default_config_path()
    assert path is not None and path.resolve() == (CONFIG_DIR / "cpu.yaml").resolve()
    config = load_config(path)
    assert config.tensor_parallel_size is None
    for world_size in (1, 2, 3, 4):
        assert resolve_tp_size(config, world_size) == world_size
    assert config.device == "cpu" and config.dtype == "auto" and config.enforce_eager
    assert config.cpu_kv_cache_gib == 0.5 and config.block_size == 16


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
    ("dtype", "dtype: fp16", "dtype='fp16'", ["float32", "bfloat16", "float16"]),
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
    with pytest.raises(ConfigError, match=r"^RtpConfig: block_size=3 is invalid"):
        RtpConfig(block_size=3)
    with pytest.raises(ConfigError, match=r"^RtpConfig: server\.port=-1 is invalid"):
        RtpConfig(server={"port": -1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^ServerConfig: default_max_tokens=9 is invalid"):
        ServerConfig(max_tokens_limit=8, default_max_tokens=9)
    config = RtpConfig(server={"port": 0})  # type: ignore[arg-type]
    assert isinstance(config.server, ServerConfig) and config.server.port == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]


def test_normalisation(tmp_path: Path) -> None:
    text = "gpu_memory_utilization: 1\nlog_level: debug\nliveness_timeout_s: 5\n"
    config = load_config(write(tmp_path, text))
    assert config.gpu_memory_utilization == 1.0 and isinstance(config.gpu_memory_utilization, float)
    assert isinstance(config.liveness_timeout_s, float)
    assert config.log_level == "DEBUG"
    assert load_config(model=tmp_path).model == str(tmp_path)  # a PathLike becomes a str


def test_liveness_defaults_catch_a_hung_rank_within_ten_seconds_on_cpu() -> None:
    cpu = load_config(CONFIG_DIR / "cpu.yaml")
    # Caught once the heartbeat is this old, plus a watchdog round and the exit (about a second).
    assert cpu.liveness_timeout_s <= 9
    assert cpu.step_timeout_s is not None and cpu.step_timeout_s >= 60  # room for a long CPU prefill
    for name in GPU_FILES:
        gpu = load_config(CONFIG_DIR / f"{name}.yaml")
        # Generous on GPU (a C call holding the GIL starves the heartbeat), and a step gets minutes.
        assert 10 <= gpu.liveness_timeout_s <= 60 and gpu.step_timeout_s >= 120, name
    assert config_from_dict({"step_timeout_s": None}).step_timeout_s is None  # null: no stuck-step check
    assert RtpConfig().liveness_timeout_s <= 10


def test_api_key_is_not_in_repr() -> None:
    config = RtpConfig(server=ServerConfig(api_key="s3cret-value"))
    assert config.server.api_key == "s3cret-value"
    assert "s3cret-value" not in repr(config)


def test_every_field_has_a_rule_and_a_docstring() -> None:
    for cls in (RtpConfig, ServerConfig):
        names = [f.name for f in dataclasses.fields(cls)]
        assert list(config_module._RULES[cls]) == names
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
    assert config.block_size == 32
    assert config.max_num_seqs == 8  # not overridden: the file's value
    assert config.server.port == 0
    assert config.server.host == "0.0.0.0"  # the file's server mapping is merged, not replaced


def test_override_replaces_a_bad_file_value(tmp_path: Path) -> None:
    path = write(tmp_path, "block_size: 3\n")
    assert load_config(path, block_size=64).block_size == 64


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
    config = RtpConfig(tensor_parallel_size=4)
    assert resolve_tp_size(config, 4) == 4
    with pytest.raises(ConfigError) as info:
        resolve_tp_size(config, 2)
    message = str(info.value)
    assert "\n" not in message
    assert "tensor_parallel_size=4" in message and "2 ranks" in message
    assert "torchrun --nproc-per-node 4" in message


@pytest.mark.parametrize("world_size", [0, -1, True])
def test_tp_size_rejects_bad_world_size(world_size: int) -> None:
    with pytest.raises(ConfigError, match="world size"):
        resolve_tp_size(RtpConfig(), world_size)
