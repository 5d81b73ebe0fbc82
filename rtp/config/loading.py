"""Reading a config: YAML files (flat or sectioned keys), keyword overrides, the source of every bad value.

Both spellings are accepted, and may be mixed::

    block_size: 16            # flat: today's top-level keys
    cache:                    # sectioned
      block_size: 16

``model:`` is the checkpoint path when its value is a string or null, and the
model section when it is a mapping. A setting given twice in one mapping (as
``block_size`` and as ``cache.block_size``) is an error; a keyword override
replaces the file's value.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from rtp.config.rules import type_name
from rtp.config.sections import (
    Given,
    RtpConfig,
    Section,
    flat_keys,
    section_fields,
    section_settings,
    section_value,
    validated,
)
from rtp.errors import ConfigError
from rtp.log import get_logger

logger = get_logger(__name__)

OVERRIDE_SOURCE = "override"
"""Source named in errors about values passed to :func:`load_config` as keyword overrides."""

_TOP_LEVEL = ("log_level",)  # settings of RtpConfig itself, outside any section


def _allowed_keys() -> str:
    return ", ".join([*section_fields(), *_TOP_LEVEL]) + "; flat keys: " + ", ".join(flat_keys())


def _unknown_key(key: Any, source: str) -> ConfigError:
    where = key if isinstance(key, str) else repr(key)
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, [*section_fields(), *_TOP_LEVEL, *flat_keys()], n=1, cutoff=0.6)
        homes = [name for name, cls in section_fields().items()
                 if key in {f.name for f in fields(cls)}]
        if homes:  # a field's own name, valid only inside its section (a server setting, a renamed field)
            hint = f" (did you mean '{homes[0]}.{key}'? {homes[0]} settings go under a `{homes[0]}:` mapping)"
        elif close:
            hint = f" (did you mean '{close[0]}'?)"
    return ConfigError(f"{source}: unknown key '{where}'{hint}; allowed keys: {_allowed_keys()}")


def _settings(data: Mapping[Any, Any], source_of: Callable[[str], str], *, overrides: bool = False
              ) -> dict[str, Given]:
    """The settings ``data`` gives, by dotted key ("cache.block_size", "log_level"), each with its spelling.

    ``overrides``: None values (at any depth) are ignored and a later spelling of a setting replaces an
    earlier one; in a file both spellings of one setting are an error.
    """
    sections, flat = section_fields(), flat_keys()
    out: dict[str, Given] = {}

    def put(dotted: str, value: Any, key: str) -> None:
        if overrides and value is None:
            return
        if dotted in out and not overrides:
            raise ConfigError(f"{source_of(key)}: {out[dotted].key} and {key} both set {dotted}: keep one")
        out[dotted] = Given(value, key, source_of(key))

    for key, value in data.items():
        cls = sections.get(key) if isinstance(key, str) else None
        if cls is not None and (key != "model" or isinstance(value, (Mapping, Section))):
            if value is None:
                continue  # the section's defaults
            if isinstance(value, cls):
                value = {f.name: getattr(value, f.name) for f in fields(value)}
            elif not isinstance(value, Mapping):
                section_value(cls, Given(value, key, source_of(key)))  # raises: names what is allowed
            for g in section_settings(cls, value, key, source_of).values():
                put(g.key, g.value, g.key)
        elif isinstance(key, str) and key in flat:
            put(flat[key], value, key)
        elif isinstance(key, str) and key in _TOP_LEVEL:
            put(key, value, key)
        else:
            raise _unknown_key(key, source_of(key if isinstance(key, str) else repr(key)))
    return out


def _build(settings: Mapping[str, Given]) -> RtpConfig:
    """Validate ``settings`` (dotted key -> given value) and build the config; defaults fill the rest."""
    top: dict[str, Given] = {}
    for name, cls in section_fields().items():
        given = {dotted.partition(".")[2]: g for dotted, g in settings.items() if dotted.startswith(name + ".")}
        top[name] = Given(cls(**validated(cls, given)), name, "")
    top.update({key: settings[key] for key in _TOP_LEVEL if key in settings})
    return RtpConfig(**validated(RtpConfig, top))


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, source: str) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        shipped = default_config_path()
        hint = ""
        if shipped is not None:
            names = sorted(p.name for p in shipped.parent.glob("*.yaml"))
            hint = f" (shipped configs in {shipped.parent}: {', '.join(names)})"
        raise ConfigError(f"{source}: config file not found{hint}") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: is not UTF-8 text, expected a YAML file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        raise ConfigError(f"{source}: cannot read the config file: {reason}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:  # an empty file (or only comments): every default
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: the top level must be a mapping of settings (key: value), got {type_name(data)}; "
            f"allowed keys: {_allowed_keys()}"
        )
    return data


# --------------------------------------------------------------------------- public


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> RtpConfig:
    """Build and validate an :class:`RtpConfig` from a mapping of flat and/or sectioned keys."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type_name(data)}")
    return _build(_settings(data, lambda _key: source))


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> RtpConfig:
    """Load ``path`` (None: the built-in defaults), apply ``overrides`` and validate once.

    ``overrides`` are keys as in the YAML: flat ones (``block_size=32``) and section mappings
    (``server={"port": 0}``), merged setting by setting into the file's. Overrides whose value is
    None are ignored, so command-line flags that were not given change nothing; errors about an
    override name the source ``override``.
    """
    source = "<defaults>" if path is None else os.fspath(path)
    data: Mapping[str, Any] = {} if path is None else _read_yaml(Path(path), source)
    settings = _settings(data, lambda _key: source)
    given = _settings(overrides, lambda _key: OVERRIDE_SOURCE, overrides=True)
    settings.update(given)
    config = _build(settings)
    logger.debug("loaded config from %s with overrides %s", source, sorted(given))
    return config


def replace_settings(config: RtpConfig, **overrides: Any) -> RtpConfig:
    """``config`` with ``overrides`` (spelled as for :func:`load_config`, None values ignored) applied."""
    settings = _settings(dataclasses.asdict(config), lambda _key: type(config).__name__)
    settings.update(_settings(overrides, lambda _key: OVERRIDE_SOURCE, overrides=True))
    return _build(settings)


def default_config_path() -> Path | None:
    """The repository's ``configs/cpu.yaml``, or None when it is not shipped (an installed wheel).

    ``load_config(default_config_path())`` therefore falls back to the built-in
    defaults when the file is missing.
    """
    path = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
    return path if path.is_file() else None


def check_combinations(config: RtpConfig) -> None:
    """ConfigError for settings each valid alone but not together (the launcher checks before any rank starts,
    every rank again)."""
    pp, dp = config.parallel.pipeline_parallel_size, config.parallel.data_parallel_size
    if pp > 1 and dp > 1:
        raise ConfigError(f"pipeline_parallel_size={pp} with data_parallel_size={dp} is not supported yet: "
                          "use one of them")
    if pp > 1 and config.speculative_config.method == "eagle3":
        raise ConfigError("speculative_config.method='eagle3' is not implemented with pipeline parallelism: the "
                          "hidden states it reads come from layers on several stages")
    if config.model.batch_invariant and config.speculative_config.method == "eagle3":
        raise ConfigError("speculative_config.method='eagle3' with model.batch_invariant=true is not supported: the "
                          "steps that return the head's hidden states run outside the batch-invariant kernels")


def resolve_tp_size(config: RtpConfig, world_size: int) -> int:
    """The tensor-parallel size of this run: world_size / (pipeline_parallel_size x data_parallel_size), and
    ``tensor_parallel_size`` if set must equal it."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world size {world_size!r} is invalid: expected an integer >= 1")
    check_combinations(config)
    pp, dp = config.parallel.pipeline_parallel_size, config.parallel.data_parallel_size
    split, what = (dp, "data_parallel_size") if dp > 1 else (pp, "pipeline_parallel_size")
    if world_size % split:
        raise ConfigError(
            f"{what}={split} does not divide the {world_size} rank{'s' if world_size != 1 else ''} "
            f"started by torchrun: start tensor_parallel_size x {split} ranks"
        )
    tp = config.parallel.tensor_parallel_size
    if tp is None:
        return world_size // split
    if tp * split != world_size:
        times = f" x {what} {split}" if split > 1 else ""
        raise ConfigError(
            f"tensor_parallel_size={tp}{times} does not match the {world_size} rank{'s' if world_size != 1 else ''} "
            "started by torchrun: "
            f"run `torchrun --nproc-per-node {tp * split} ...` "
            f"or change tensor_parallel_size to {world_size // split} (or null)"
        )
    return tp


def checkpoint_dir(config: RtpConfig) -> Path:
    """The checkpoint folder ``config`` names (the shipped trained model where it names none); ConfigError where
    it holds no config.json."""
    from rtp.assets import trained_model_dir

    path = Path(config.model.path) if config.model.path else trained_model_dir()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model={str(path)!r} is not a Hugging Face checkpoint folder (no config.json there); "
            "give a local folder: rtp never downloads from a model hub"
        )
    return path
