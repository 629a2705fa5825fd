"""Checks of one configuration field each, shared by the configuration dataclasses
(engine.config, engine.watchdog.settings, engine.checkpoint.plan): each raises ConfigError naming
the owner, the field, the value received and what was expected."""

from __future__ import annotations

import math
from typing import Sequence

from engine.errors import ConfigError


def positive_int_or_none(owner: str, name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}.{name}: expected a positive int or None, got {value!r}")


def positive_number_or_none(owner: str, name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigError(f"{owner}.{name}: expected a positive finite number or None, got {value!r}")


def bool_field(owner: str, name: str, value: object) -> None:
    # Not ``value in (True, False)``: 1 == True, and a 0 or "no" would be taken for a flag.
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name}: expected True or False, got {value!r}")


def one_of(owner: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{name}: expected one of {list(allowed)}, got {value!r}")
