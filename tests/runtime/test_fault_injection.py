"""The test-only step delay hook: off unless its variable is set, strict about its format."""

from __future__ import annotations

import time

import pytest

from rtp.errors import ConfigError
from rtp.runtime.fault_injection import ENV_VAR, StepDelay


def test_off_by_default_and_parsed_when_set():
    assert StepDelay.from_env({}) is None
    assert StepDelay.from_env({ENV_VAR: " "}) is None
    assert StepDelay.from_env({ENV_VAR: "1:5:2.5"}) == StepDelay(rank=1, step=5, seconds=2.5)
    assert StepDelay.from_env({ENV_VAR: "0:2+:0.01"}) == StepDelay(rank=0, step=2, seconds=0.01, onwards=True)


@pytest.mark.parametrize("text", ["1:5", "a:5:1", "1:0:1", "-1:5:1", "1:5:-2", "1:5:nan", "1:5:1:9", "1:5++:1",
                                  "1:+:1"])
def test_a_malformed_value_names_the_variable(text):
    with pytest.raises(ConfigError, match=rf"^{ENV_VAR}=.* is invalid: expected RANK:STEP\[\+\]:SECONDS"):
        StepDelay.from_env({ENV_VAR: text})


def test_only_the_chosen_rank_and_step_sleep():
    delay = StepDelay(rank=1, step=3, seconds=0.5)
    t0 = time.monotonic()
    delay.apply(0, 3)
    delay.apply(1, 2)
    assert time.monotonic() - t0 < 0.4  # no sleep (with room for a loaded machine: tests run two at a time)
    delay.apply(1, 3)
    assert time.monotonic() - t0 >= 0.5


def test_onwards_sleeps_in_every_later_step_only():
    delay = StepDelay(rank=0, step=3, seconds=0.5, onwards=True)
    t0 = time.monotonic()
    delay.apply(0, 2)
    delay.apply(1, 4)
    assert time.monotonic() - t0 < 0.4  # no sleep
    for step in (3, 4, 9):
        delay.apply(0, step)
    assert time.monotonic() - t0 >= 1.5
