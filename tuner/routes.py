"""Routes: knob combinations in TensorRT-tuner syntax, their canonical strings, and what each strategy enumerates.

    -opt=all -fusion=[none|bert] -quant=[fp32|int8-channel]

`-k=v` pins a knob, `-k=[a|b]` sweeps it; knobs not named keep their default. `fast` starts from
the first listed value of each sweep and changes one knob at a time. A route's canonical
string lists every knob in the builder's order (`-fusion=bert -opt=all -quant=fp32 ...`), so the
same route always has the same string (the cache key and release.json's "route").

The syntax is trtexec's `--setBuildRoute` / `--tuneBuildRoutes` syntax (TensorRT's sampleTuning.cpp):
tokens split on white space outside brackets (a `--tuneBuildRouteFile`'s one token a line reads the same),
a knob name is everything between the dash and the first `=` (`-kgen:codegen:cuda_tile=[0|1]`), and the
values inside brackets are trimmed (`-k=[a | b]`). Stricter than trtexec: an empty value (`[a||b]`) or a
knob named twice is an error here.
Everything here is pure: tested on data, no builds.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence

from tunegate.errors import InputError

_TOKEN = re.compile(r"^-(?P<knob>[^\s=\[\]|]+)=(?P<value>\[[^\[\]]*\]|[^\s\[\]|]+)$")


class RouteError(InputError):
    """A route expression or route string that does not fit the builder's knobs."""


@dataclasses.dataclass(frozen=True)
class Knob:
    """One build knob: its allowed values (as strings), the default and a line of help."""

    name: str
    values: tuple[str, ...]
    default: str
    help: str

    def __post_init__(self) -> None:
        if self.default not in self.values:
            raise ValueError(f"knob {self.name}: default {self.default!r} is not one of {self.values}")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "values": list(self.values), "default": self.default, "help": self.help}


Route = tuple[tuple[str, str], ...]  # ((knob, value), ...) in the builder's knob order


def route_string(route: Route) -> str:
    return " ".join(f"-{k}={v}" for k, v in route)


def as_dict(route: Route) -> dict[str, str]:
    return dict(route)


def make_route(knobs: Sequence[Knob], values: Mapping[str, str]) -> Route:
    """A complete route: every knob, in order, with `values` over the defaults (validated)."""
    by_name = {k.name: k for k in knobs}
    for name, v in values.items():
        if name not in by_name:
            raise RouteError(f"unknown knob -{name} (knobs: {', '.join('-' + k.name for k in knobs)})")
        if v not in by_name[name].values:
            raise RouteError(f"-{name}={v}: not an allowed value (allowed: {'|'.join(by_name[name].values)})")
    return tuple((k.name, values.get(k.name, k.default)) for k in knobs)


def parse_route(knobs: Sequence[Knob], text: str) -> Route:
    """A single route from its string (every knob pinned or defaulted)."""
    space = parse_space(knobs, text)
    swept = [k for k, vs in space.items() if len(vs) > 1]
    if swept:
        raise RouteError(f"{text!r} sweeps {', '.join('-' + k for k in swept)}; a route pins every knob")
    return make_route(knobs, {k: vs[0] for k, vs in space.items()})


def tokens(expression: str) -> list[str]:
    """The expression's tokens: split on white space outside brackets, as trtexec's tokenizer does."""
    out: list[str] = []
    current: list[str] = []
    depth = 0
    for c in expression:
        if c.isspace() and depth == 0:
            if current:
                out.append("".join(current))
                current = []
            continue
        depth += (c == "[") - (c == "]")
        current.append(c)
    if current:
        out.append("".join(current))
    return out


def read_expression(expression: str) -> dict[str, tuple[str, ...]]:
    """Knob name -> the values the expression lists, in the order written (syntax only, no knob checked)."""
    chosen: dict[str, tuple[str, ...]] = {}
    for token in tokens(expression):
        m = _TOKEN.match(token)
        if not m:
            raise RouteError(f"cannot read {token!r}: expected -knob=value or -knob=[a|b]")
        name, raw = m.group("knob"), m.group("value")
        if name in chosen:
            raise RouteError(f"-{name} appears twice in the route expression")
        values = tuple(v.strip() for v in raw[1:-1].split("|")) if raw.startswith("[") else (raw,)
        if not values or any(not v for v in values):
            raise RouteError(f"-{name}={raw}: empty value")
        if len(set(values)) != len(values):
            raise RouteError(f"-{name}={raw}: a value is listed twice")
        chosen[name] = values
    return chosen


def parse_space(knobs: Sequence[Knob], expression: str) -> dict[str, tuple[str, ...]]:
    """Knob name -> values to try, for every knob (unnamed knobs: their default only)."""
    by_name = {k.name: k for k in knobs}
    chosen = read_expression(expression)
    for name, values in chosen.items():
        if name not in by_name:
            raise RouteError(f"unknown knob -{name} (knobs: {', '.join('-' + k.name for k in knobs)})")
        for v in values:
            if v not in by_name[name].values:
                raise RouteError(
                    f"-{name}={v}: not an allowed value (allowed: {'|'.join(by_name[name].values)})"
                )
    return {k.name: chosen.get(k.name, (k.default,)) for k in knobs}


def base_route(knobs: Sequence[Knob], space: Mapping[str, tuple[str, ...]]) -> Route:
    """The route the fast strategy starts from: each knob's first listed value (its default when not named).

    The spec author picks the starting point by the order of a sweep: `-fusion=[bert|none]` starts fused.
    """
    return tuple((k.name, space[k.name][0]) for k in knobs)


def _dedupe(routes: Iterable[Route]) -> list[Route]:
    return list(dict.fromkeys(routes))


def full_routes(knobs: Sequence[Knob], space: Mapping[str, tuple[str, ...]]) -> list[Route]:
    names = [k.name for k in knobs]
    return _dedupe(
        tuple(zip(names, combo, strict=True)) for combo in itertools.product(*(space[n] for n in names))
    )


def fast_routes(knobs: Sequence[Knob], space: Mapping[str, tuple[str, ...]]) -> list[Route]:
    """The base route, then one knob changed at a time."""
    base = base_route(knobs, space)
    out = [base]
    for i, (name, value) in enumerate(base):
        for v in space[name]:
            if v != value:
                out.append(base[:i] + ((name, v),) + base[i + 1 :])
    return _dedupe(out)


def mixed_routes(
    knobs: Sequence[Knob], space: Mapping[str, tuple[str, ...]], helped: Iterable[Route]
) -> list[Route]:
    """After `fast`: the product of the knob values whose one-knob change helped (base values always kept)."""
    base = base_route(knobs, space)
    keep: dict[str, list[str]] = {name: [value] for name, value in base}
    for route in helped:
        for (name, value), (_, bvalue) in zip(route, base, strict=True):
            if value != bvalue and value not in keep[name]:
                keep[name].append(value)
    return full_routes(knobs, {k: tuple(v) for k, v in keep.items()})


def count_strategy(
    strategy: str, knobs: Sequence[Knob], space: Mapping[str, tuple[str, ...]]
) -> dict[str, int]:
    """How many routes a strategy builds up front (mixed: its fast phase; halving: all, then a fraction)."""
    return {
        "fast": len(fast_routes(knobs, space)),
        "mixed": len(fast_routes(knobs, space)),
        "full": len(full_routes(knobs, space)),
        "halving": len(full_routes(knobs, space)),
    }
