"""SamplingParams validation: every bad field raises RequestError naming it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rtp.errors import RequestError, RtpError
from rtp.sampling import SamplingParams

INVALID: list[tuple[str, Any]] = [
    ("n", 129),
    ("n", 0),
    ("n", True),
    ("n", 1.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: math.inf}),
    ("allowed_token_ids", []),
    ("prompt_logprobs", 21),
    ("temperature", -0.1),
    ("temperature", 100.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", None),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", False),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("include_stop_str_in_output", 1),
    ("stop", 5),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", ("a", "b")),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 7),
    ("stop_token_ids", [True]),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("skip_special_tokens", 0),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_field_names_the_field(name: str, value: Any) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**{name: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, RtpError)
    assert f"SamplingParams.{name}=" in str(info.value)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(RequestError, match=r"SamplingParams\.min_tokens=.*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=500, max_tokens=None).min_tokens == 500


def test_a_seed_leaves_room_for_each_samples_seed() -> None:
    """Sample i of n uses seed + i: the error names the request's own seed and why, not seed + i."""
    with pytest.raises(RequestError, match=r"SamplingParams\.seed=18446744073709551615 .*n=2 .*seed \+ i"):
        SamplingParams(seed=2**64 - 1, n=2)
    assert SamplingParams(seed=2**64 - 2, n=2).seed == 2**64 - 2 and SamplingParams(seed=2**64 - 1).seed


def test_defaults_and_valid_values() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.greedy
    edge = SamplingParams(
        temperature=0, top_p=1e-9, top_k=0, min_p=1, seed=-5, stop="x", stop_token_ids=[0], logprobs=20
    )
    assert edge.greedy and edge.stop_strings == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop="").stop_strings == []
    assert SamplingParams(temperature=100, top_k=1, logprobs=0, max_tokens=None).max_tokens is None
