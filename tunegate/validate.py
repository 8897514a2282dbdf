"""Checks of numbers in configuration (the tuner's spec, the sidecar's config, canary parameters), one wording
everywhere; each raises the caller's InputError subclass, whose message names the setting."""

from __future__ import annotations

import math

from tunegate.errors import InputError


def _number(name: str, v: object, error: type[InputError]) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise error(f"{name} must be a number, got {v!r}")
    return float(v)


def positive(name: str, v: object, error: type[InputError], *, allow_zero: bool = False) -> None:
    """`v` a finite number > 0 (>= 0 with `allow_zero`)."""
    x = _number(name, v, error)
    if x < 0 or (x == 0 and not allow_zero):
        raise error(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


def fraction(name: str, v: object, error: type[InputError], *, open_low: bool = False) -> None:
    """`v` within [0, 1] ((0, 1] with `open_low`)."""
    x = _number(name, v, error)
    if not (0.0 < x <= 1.0 if open_low else 0.0 <= x <= 1.0):
        raise error(f"{name} must be within {'(0, 1]' if open_low else '[0, 1]'}, got {v!r}")
