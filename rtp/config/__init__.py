"""Typed, validated configuration in sections: dataclasses, YAML loading, clear errors.

The config is loaded and validated once, at the edge (``launch/`` or
``rtp.init``). Every bad value raises :class:`rtp.errors.ConfigError` with one
line that names the source (a file, ``override`` or the class), the key as it
was written, the bad value and what is allowed::

    configs/x.yaml: block_size=-3 is invalid: expected a power of two between 1 and 1024 or null

Three modules, one idea each: ``rules`` (how one value is checked; a rule sits
in its field's metadata), ``sections`` (the dataclasses: model, parallel,
cache, scheduler, liveness, server) and ``loading`` (YAML in flat or sectioned
form, overrides, the source of each value).

Values derived from the config (number of KV blocks, eos id, resolved dtype)
belong to runtime objects; they are never written back into these frozen
dataclasses.
"""

from rtp.config.loading import (
    OVERRIDE_SOURCE,
    check_combinations,
    checkpoint_dir,
    config_from_dict,
    default_config_path,
    load_config,
    replace_settings,
    resolve_tp_size,
)
from rtp.config.sections import (
    CacheConfig,
    LivenessConfig,
    ModelConfig,
    ParallelConfig,
    RtpConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    flat_keys,
    setting_keys,
    value_of,
)

__all__ = [
    "OVERRIDE_SOURCE", "CacheConfig", "LivenessConfig", "ModelConfig", "ParallelConfig", "RtpConfig",
    "SchedulerConfig", "ServerConfig", "SpeculativeConfig", "check_combinations",
    "checkpoint_dir", "config_from_dict", "default_config_path",
    "flat_keys", "load_config", "replace_settings", "resolve_tp_size", "setting_keys", "value_of",
]
