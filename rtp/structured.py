"""Structured outputs: grammars compiled with xgrammar, one matcher per output sequence.

A request names its constraint as a :class:`GrammarSpec`: a JSON schema, any JSON object, a
regular expression, a choice among strings or an EBNF grammar (vLLM's ``guided_*`` kinds).
:class:`GrammarCompiler` turns a spec into an xgrammar ``CompiledGrammar`` (cached by
``(kind, spec)``; compile it off the step loop, it can take tens of milliseconds) and
:meth:`GrammarCompiler.constraint_factory` into the zero-argument factory that
``SamplingParams.constraint`` takes: the engine calls it once per output sequence and gets a
fresh :class:`GrammarConstraint`, which the batched sampler asks for the allowed tokens before
every step and tells the sampled token after it (the hook of rtp.runtime.sampler).

The grammar's stop tokens are the model's EOS ids: once the grammar is complete only they are
allowed, so the request finishes with ``finish_reason="stop"`` like any EOS.

xgrammar is optional (the ``serve`` extra): without it rtp imports and runs, and a request that
needs a grammar gets :class:`StructuredOutputsUnavailable`.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rtp.errors import RequestError
from rtp.log import get_logger

logger = get_logger(__name__)

_xgr: Any
try:  # optional dependency
    import xgrammar as _xgr
except ImportError:  # pragma: no cover - exercised only without the serve extra
    _xgr = None

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; clients need only the rest.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def available() -> bool:
    """True when xgrammar is installed."""
    return _xgr is not None


class StructuredOutputsUnavailable(RequestError):
    """A request needs a grammar but xgrammar is not installed."""


class GrammarCompileError(RequestError):
    """A grammar that xgrammar refused; ``field`` is the request field that carried it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint of a request.

    ``spec`` is text: a JSON schema serialised (equal schemas share a cache entry), a regex, a JSON
    list of choices, an EBNF grammar, or "" for json_object. ``field`` names the request field it
    came from, for error messages. ``after``: a token id (a thinking model's ``</think>``) until which
    the output is free, the grammar applying from the token after it (as vLLM with a reasoning parser);
    None: from the first token.
    """

    kind: GrammarKind
    spec: str
    field: str
    after: int | None = None

    @staticmethod
    def json_schema(schema: Any, field: str) -> GrammarSpec:  # noqa: ANN401 - any JSON value
        if isinstance(schema, str):  # vLLM accepts a schema serialised as a string
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarCompileError(field, f"{field} is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarCompileError(field, f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
        try:
            ignored = unenforced_keyword(schema)
        except RecursionError:
            raise GrammarCompileError(field, f"{field} nests too deeply") from None
        if ignored is not None:
            raise GrammarCompileError(field, f"{field}: {ignored[1]} at {ignored[0]} is not supported (xgrammar would "
                                             "ignore it and the output could break the schema): remove it")
        # Not sort_keys: the schema's property order is the order of the generated keys.
        return GrammarSpec("json", json.dumps(schema), field)

    @staticmethod
    def choice(choices: list[str], field: str) -> GrammarSpec:
        if not choices:
            raise GrammarCompileError(field, f"{field} must list at least one choice")
        return GrammarSpec("choice", json.dumps(list(choices)), field)


# Where a schema's subschemas sit: maps of them, lists of them, and single ones. Other keys hold data (enum,
# const, default ...) or numbers, never walked.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames", "if", "then", "else")
# Keywords xgrammar (0.2) compiles without enforcing them: an output could break them while the request ends "stop".
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "dependentRequired", "dependentSchemas",
               "dependencies", "if")


def unenforced_keyword(schema: Any, path: str = "#") -> tuple[str, str] | None:  # noqa: ANN401 - any JSON value
    """(where, what) of the first keyword in ``schema`` that the grammar would not enforce, or None."""
    if not isinstance(schema, dict):
        return None
    found = next((k for k in _UNENFORCED if k in schema), None)
    if found is not None:
        return path, f"'{found}'"
    if schema.get("uniqueItems") is True:
        return path, "'uniqueItems'"
    types = schema.get("type")
    if "multipleOf" in schema and "integer" not in (types if isinstance(types, list) else [types]):
        return path, "'multipleOf' on a non-integer"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return path, "'allOf' of several schemas"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return path, "'pattern' with 'minLength'/'maxLength'"
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{path}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    children += [(f"{path}/{key}", schema[key]) for key in _SCHEMA_ONE if isinstance(schema.get(key), dict)]
    return next((hit for where, sub in children if (hit := unenforced_keyword(sub, where)) is not None), None)


def _regex_escape(text: str) -> str:
    """``text`` as a regex matching exactly it (xgrammar's regex dialect, ECMAScript-like)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


class GrammarConstraint:
    """The grammar state of one output sequence (rtp.sampling.TokenConstraint).

    Only the engine's stepping thread uses it, one call at a time.
    """

    def __init__(self, compiled: Any, vocab_size: int,  # noqa: ANN401 - xgrammar.CompiledGrammar
                 also_allowed: torch.Tensor | None = None, after: int | None = None) -> None:
        assert _xgr is not None, "built by GrammarCompiler only"
        self.matcher = _xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = _xgr.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(vocab / 32)], on CPU
        self._also_allowed = also_allowed  # packed like the bitmask: AND-ed into it
        self.rejected = 0  # tokens the grammar did not accept (a mask that could not be honoured)
        self._after = after  # GrammarSpec.after
        self._waiting = after is not None  # free output until the ``after`` token
        self._matched = 0  # tokens the matcher accepted (a rollback past them returns to free output)

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """The packed bitmask of the tokens the grammar allows next, or None when it allows all."""
        if self._waiting or self.matcher.is_terminated():
            return None  # finished: the engine stops the sequence after this token anyway
        if not self.matcher.fill_next_token_bitmask(self._bitmask, 0):
            return self._also_allowed
        if self._also_allowed is not None:
            self._bitmask[0] &= self._also_allowed
        return self._bitmask[0]

    def accept(self, token_id: int) -> None:
        if self._waiting:
            self._waiting = token_id != self._after
            return
        if self.matcher.is_terminated():
            return
        self._matched += 1
        if not self.matcher.accept_token(token_id):
            self.rejected += 1
            logger.warning("the grammar rejected token %d (the output may not match it)", token_id)

    def is_terminated(self) -> bool:
        return not self._waiting and bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (draft tokens checked for a verification step)."""
        matched = min(num_tokens, self._matched)
        if matched:
            self.matcher.rollback(matched)
            self._matched -= matched
        if num_tokens > matched:  # back before the ``after`` token (the last free one): free output again
            self._waiting = True


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer, with an LRU cache of the compiled grammars.

    ``vocab_size`` is the model's (padded) vocabulary: ids past the tokenizer's are never
    allowed. Thread-safe: the server compiles on a worker thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],  # noqa: ANN401
                 cache_size: int = 128, max_threads: int = 2) -> None:
        if _xgr is None:
            raise StructuredOutputsUnavailable(
                "structured outputs need xgrammar, which is not installed (pip install -e '.[serve]')")
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        info = _xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                   stop_token_ids=list(stop_token_ids) or None)
        # rtp keeps its own LRU of whole grammars; xgrammar's cache would be a second, unbounded copy.
        self._compiler = _xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._json_safe = pack_bitmask(json_safe_tokens(tokenizer, self.vocab_size))
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> Any:  # noqa: ANN401 - xgrammar.CompiledGrammar
        """The compiled grammar of ``spec``; GrammarCompileError (naming spec.field) if it does not compile."""
        key = (spec.kind, spec.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
            self.misses += 1
            try:
                compiled = self._compile(spec)
            except GrammarCompileError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
                text = str(e).strip()
                first = _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
                raise GrammarCompileError(spec.field, f"{spec.field}: the grammar does not compile: {first}") from None
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> Any:  # noqa: ANN401
        c = self._compiler
        # Compact JSON (no free whitespace between tokens): a model cannot stall in endless blank space.
        if spec.kind == "json":
            return c.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_regex("|".join(f"({_regex_escape(x)})" for x in json.loads(spec.spec)))
        if spec.kind == "grammar":
            return c.compile_grammar(spec.spec)
        raise GrammarCompileError(spec.field, f"unknown grammar kind {spec.kind!r}: one of {', '.join(KINDS)}")

    def constraint_factory(self, compiled: Any, spec: GrammarSpec) -> Callable[[], GrammarConstraint]:  # noqa: ANN401
        """The SamplingParams.constraint factory: a fresh matcher per output sequence.

        JSON kinds also exclude every token holding an ASCII control character: xgrammar's JSON
        strings admit raw control characters, which JSON forbids (they must be escaped), and compact
        JSON needs none outside strings.
        """
        vocab_size, after = self.vocab_size, spec.after
        also = self._json_safe if spec.kind in ("json", "json_object") else None

        def make() -> GrammarConstraint:
            return GrammarConstraint(compiled, vocab_size, also, after)

        return make


def json_safe_tokens(tokenizer: Any, vocab_size: int) -> torch.Tensor:  # noqa: ANN401
    """Bool [vocab_size]: tokens whose text has no ASCII control character (ids past the tokenizer: False)."""
    n = min(len(tokenizer), vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    ok[:n] = torch.tensor([not any(ord(c) < 0x20 for c in t) for t in texts], dtype=torch.bool)
    return ok


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """A bool [vocab] mask as xgrammar's packed int32 words: bit j of word i is token 32 * i + j."""
    words = (allowed.numel() + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.numel()] = allowed.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32)).sum(dim=1)  # < 2**32: fits int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement
