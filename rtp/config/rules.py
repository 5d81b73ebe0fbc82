"""How one config value is checked: a :class:`Rule` kept in its field's metadata, and the one-line errors.

A field declares its default and its rule together, ``block_size: int | None =
setting(None, power_of_two(1, 1024, nullable=True))``, so the range a field's
docstring states is written once, next to it. Errors have one form everywhere::

    configs/x.yaml: block_size=-3 is invalid: expected a power of two between 1 and 1024 or null
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any

from rtp.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """How one field is checked: its kind, an optional range test and the text naming what is allowed."""

    kind: str  # "int" | "float" | "bool" | "str" | "choice" | "ints"
    allowed: str  # completes "expected ...", e.g. "an integer >= 1"
    ok: Callable[[Any], bool] | None = None
    nullable: bool = False
    choices: tuple[str, ...] = ()
    fold_case: bool = False  # compare choices case-insensitively and store the canonical spelling
    aliases: tuple[tuple[str, str], ...] = ()  # (other spelling, choice): vLLM's names for the same value


def integer(lo: int, hi: int | None = None, nullable: bool = False) -> Rule:
    """An int in [lo, hi] (no upper bound when ``hi`` is None); bools are refused."""
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    ok = (lambda v: v >= lo) if hi is None else (lambda v: lo <= v <= hi)
    return Rule("int", text + (" or null" if nullable else ""), ok, nullable)


def power_of_two(lo: int, hi: int, nullable: bool = False) -> Rule:
    """An int power of two in [lo, hi]."""
    return Rule("int", f"a power of two between {lo} and {hi}" + (" or null" if nullable else ""),
                lambda v: lo <= v <= hi and v & (v - 1) == 0, nullable)


def number(allowed: str, ok: Callable[[float], bool], nullable: bool = False) -> Rule:
    """A finite int or float, stored as float; ``allowed`` names the range ``ok`` tests ("a number > 0")."""
    return Rule("float", allowed + (" or null" if nullable else ""), ok, nullable)


def text(allowed: str, nullable: bool = False) -> Rule:
    """A non-blank string (a PathLike becomes its str)."""
    return Rule("str", allowed + (" or null" if nullable else ""), nullable=nullable)


def choice(*choices: str, fold_case: bool = False, nullable: bool = False,
           aliases: dict[str, str] | None = None) -> Rule:
    """One of ``choices``; with ``fold_case`` any case, stored in the spelling given here; ``aliases`` maps
    other accepted spellings to the choice they stand for."""
    if nullable:
        allowed = ("one of " if len(choices) > 1 else "") + ", ".join(choices) + " or null"
    else:
        allowed = "one of " + ", ".join(choices)
    return Rule("choice", allowed, choices=choices, nullable=nullable, fold_case=fold_case,
                aliases=tuple((aliases or {}).items()))


BOOL = Rule("bool", "true or false")


def int_list(lo: int, nullable: bool = False) -> Rule:
    """A non-empty list of ints >= ``lo`` (YAML list, or "a,b,c" from a flag), stored as a tuple."""
    return Rule("ints", f"a non-empty list of integers >= {lo}" + (" or null" if nullable else ""),
                lambda v: all(x >= lo for x in v), nullable)


def setting(default: Any, rule: Rule, *, flat: str | None = None, repr: bool = True) -> Any:  # noqa: A002
    """A config field: its default and its rule (``flat``: the top-level YAML key when it is not the field's name).

    ``flat`` matters only in sections whose fields have flat spellings (see ``Section.flat``).
    """
    metadata: dict[str, Any] = {"rule": rule}
    if flat is not None:
        metadata["flat"] = flat
    return field(default=default, metadata=metadata, repr=repr)


def rule_of(f: Field[Any]) -> Rule:
    """The rule a config field was declared with."""
    return f.metadata["rule"]


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (repr escapes newlines, so a message stays one line)."""
    text_ = repr(value)
    return text_ if len(text_) <= limit else text_[: limit - 3] + "..."


def type_name(value: Any) -> str:
    """"a boolean", "an integer", ...: the YAML kind of ``value`` for an error message."""
    names = {
        bool: "a boolean", int: "an integer", float: "a number",
        str: "a string", list: "a list", dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def invalid(source: str, key: str, value: Any, allowed: str, got_type: bool = False) -> ConfigError:
    """``source: key=value is invalid: expected allowed`` (plus the value's kind when its type is wrong)."""
    suffix = f" (got {type_name(value)})" if got_type else ""
    return ConfigError(f"{source}: {key}={short_repr(value)} is invalid: expected {allowed}{suffix}")


def check_value(rule: Rule, key: str, value: Any, source: str) -> Any:
    """Return ``value`` normalised (int -> float, canonical choice spelling) or raise ConfigError."""
    if value is None:
        if rule.nullable:
            return None
        raise invalid(source, key, value, rule.allowed)
    if rule.kind == "bool":
        if not isinstance(value, bool):
            raise invalid(source, key, value, rule.allowed, got_type=True)
        return value
    if rule.kind == "int":
        # bool is a subclass of int, but `block_size: true` is a mistake, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid(source, key, value, rule.allowed, got_type=True)
    elif rule.kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid(source, key, value, rule.allowed, got_type=True)
        value = float(value)
        if not math.isfinite(value):
            raise invalid(source, key, value, rule.allowed)
    elif rule.kind == "str":
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise invalid(source, key, value, rule.allowed, got_type=True)
        if not value.strip():
            raise invalid(source, key, value, rule.allowed)
    elif rule.kind == "ints":
        if isinstance(value, str):
            try:
                value = [int(x) for x in value.split(",")]
            except ValueError:
                raise invalid(source, key, value, rule.allowed) from None
        if not isinstance(value, (list, tuple)) or not value:
            raise invalid(source, key, value, rule.allowed, got_type=not isinstance(value, (list, tuple)))
        if any(not isinstance(x, int) or isinstance(x, bool) for x in value):
            raise invalid(source, key, value, rule.allowed)
        value = tuple(value)
    elif rule.kind == "choice":
        if not isinstance(value, str):
            raise invalid(source, key, value, rule.allowed, got_type=True)
        lookup = {(c.upper() if rule.fold_case else c): c for c in rule.choices}
        value = dict(rule.aliases).get(value, value)
        canonical = lookup.get(value.upper() if rule.fold_case else value)
        if canonical is None:
            raise invalid(source, key, value, rule.allowed)
        return canonical
    if rule.ok is not None and not rule.ok(value):
        raise invalid(source, key, value, rule.allowed)
    return value
