"""TensorRT's Global Performance Tuning (GPT): the knob database and build-route strings, in tunegate's terms.

What TensorRT documents, as read from the TensorRT 11.1 OSS release (github.com/NVIDIA/TensorRT at
a892d22267d9cd2dedc1a0893e6892ac901f6d3d) and the pages named:

- A knob is a compiler option, a build route a combination of knob values; with no route set every knob
  keeps its default ("Architecture" of https://docs.nvidia.com/deeplearning/tensorrt/latest/performance/tuning.html).
- `char const* IBuilderConfig::getAllBuildRoutes() const` returns the knob database as JSON, filled when the
  config is created (include/NvInfer.h):
  `{"tuner_version": "2.19.15", "tuner_options": [{"option": "-conv_use_long_w",
  "allowed_values": "-conv_use_long_w=[on|off]", "default_value": "on", "help": "..."}, ...]}`.
  Python: the read-only `str` property `IBuilderConfig.all_build_routes`, empty where GPT is disabled (RTX,
  Windows) (python/src/infer/pyCore.cpp, python/docstrings/infer/pyCoreDoc.h).
- `bool IBuilderConfig::setBuildRoute(char const* buildRoute)` and `char const* getBuildRoute() const`: a route
  is white-space separated `-name=value` tokens, e.g. `"-conv_use_long_w=off -kgen:codegen:cuda_tile=2"`
  (NvInfer.h). Python: the `str` property `IBuilderConfig.build_route`, whose knob names TensorRT checks
  against all_build_routes (pyCoreDoc.h); its setter drops setBuildRoute's bool (pyCore.cpp), so the
  builder reads the route back.
- trtexec (samples/trtexec/README.md "Example 7", samples/common/sampleOptions.cpp, sampleTuning.cpp,
  samples/trtexec/trtexec.cpp): `--helpBuildRoute[=knob]` prints the database; `--setBuildRoute=<route>`
  builds one route (it calls setBuildRoute); `--tuneBuildRoutes=<expr>` sweeps `-knob=[a|b]` and pins
  `-knob=v`, `--tuneBuildRouteFile` reads the same expression a token a line; `--tuningSearch=fast|full|mixed`.
  An `allowed_values` without a bracketed list, or with `...` in it, is an open knob: trtexec pins it (not to
  the word `int32_t`) but will not sweep it.
- torch_tensorrt's `get_all_build_routes()` is `json.loads(config.all_build_routes)`, and its example builds a
  winner again with `build_route=<route>`
  (https://docs.pytorch.org/TensorRT/tutorials/_rendered_examples/dynamo/global_perf_tuning_attention_example.html).

Not confirmed here: the tuning page past its "Architecture" section (only its opening could be read), any real
knob database (no TensorRT on this machine), and whether `build_route` reads back exactly as it was set (the
builder compares knob by knob).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence

from tuner.builders.base import BuildError
from tuner.routes import Knob, RouteError, read_expression


def allowed_values(allowed: str) -> tuple[str, ...]:
    """The closed list of an `allowed_values` string (`-k=[on|off]` -> on, off); () for an open knob."""
    start, end = allowed.find("["), allowed.find("]")
    if start < 0 or end <= start or "..." in allowed[start + 1 : end]:
        return ()
    return tuple(v.strip() for v in allowed[start + 1 : end].split("|") if v.strip())


@dataclasses.dataclass(frozen=True)
class GptKnob:
    """One `tuner_options` entry; `option` as TensorRT spells it, with its leading dash."""

    option: str
    allowed: str
    default: str
    help: str

    @property
    def name(self) -> str:
        """tunegate's name for it: the option without its dash (`-kgen:tiling` -> `kgen:tiling`)."""
        return self.option.removeprefix("-")

    @property
    def values(self) -> tuple[str, ...]:
        return allowed_values(self.allowed)


class KnobDatabase:
    """The knobs of `IBuilderConfig.all_build_routes`, in the database's order."""

    def __init__(self, tuner_version: str, knobs: Sequence[GptKnob]) -> None:
        self.tuner_version = tuner_version
        self._knobs = {k.name: k for k in knobs}

    @classmethod
    def from_json(cls, text: str) -> KnobDatabase:
        if not text.strip():
            raise BuildError(
                "IBuilderConfig.all_build_routes is empty: this TensorRT has Global Performance Tuning "
                "disabled (TensorRT-RTX and Windows builds)"
            )
        try:
            root = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BuildError(f"IBuilderConfig.all_build_routes is not JSON: {exc}") from exc
        options = root.get("tuner_options") if isinstance(root, dict) else None
        if not isinstance(options, list):
            raise BuildError("IBuilderConfig.all_build_routes has no tuner_options list")
        knobs = [
            GptKnob(
                o["option"],
                str(o.get("allowed_values", "")),
                str(o.get("default_value", "")),
                str(o.get("help", "")),
            )
            for o in options
            if isinstance(o, dict) and isinstance(o.get("option"), str) and o["option"]
        ]
        version = root.get("tuner_version")
        return cls(version if isinstance(version, str) else "unknown", knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def __iter__(self) -> Iterator[GptKnob]:
        return iter(self._knobs.values())

    def get(self, name: str) -> GptKnob | None:
        """A knob by name, with or without its dash (as `trtexec --helpBuildRoute=<knob>` takes it)."""
        return self._knobs.get(name.removeprefix("-"))

    def default_route(self) -> str:
        """Every knob at its default, in the database's order (trtexec's `default_build_route`)."""
        return " ".join(f"{k.option}={k.default}" for k in self)

    def check(self, name: str, values: Sequence[str]) -> GptKnob:
        """The knob `-name`, if `values` may be given to it as trtexec would take them; else RouteError."""
        knob = self.get(name)
        if knob is None:
            raise RouteError(
                f"unknown knob -{name}: not in TensorRT's knob database (tuner {self.tuner_version}, "
                f"{len(self)} knobs; `trtexec --helpBuildRoute` lists them)"
            )
        if knob.values:
            bad = [v for v in values if v not in knob.values]
            if bad:
                raise RouteError(f"-{name}={bad[0]}: not an allowed value (allowed: {'|'.join(knob.values)})")
        elif len(values) > 1:
            raise RouteError(f"-{name} is an open knob ({knob.allowed}): pin it, trtexec does not sweep it")
        elif values[0] == "int32_t":
            raise RouteError(f"-{name}=int32_t: give a value, not its type")
        return knob

    def knobs_for(self, chosen: Mapping[str, Sequence[str]]) -> tuple[Knob, ...]:
        """tunegate knobs for the database knobs a route expression names, in the order it names them."""
        out = []
        for name, listed in chosen.items():
            knob = self.check(name, listed)
            values = knob.values or tuple(listed)
            default = knob.default or values[0]
            out.append(Knob(knob.name, tuple(dict.fromkeys((*values, default))), default, knob.help))
        return tuple(out)

    def build_route(self, values: Mapping[str, str]) -> str:
        """The string for `config.build_route` and `trtexec --setBuildRoute`, knobs in the order given."""
        return " ".join(f"{self.check(name, [v]).option}={v}" for name, v in values.items())


def parse_build_route(text: str) -> dict[str, str]:
    """A TensorRT route string (`-kgen:tiling=1 -copy_ppg=off`) as knob name -> value; no sweeps."""
    chosen = read_expression(text)
    swept = [f"-{k}" for k, vs in chosen.items() if len(vs) > 1]
    if swept:
        raise RouteError(f"{text!r} sweeps {', '.join(swept)}; a build route pins every knob it names")
    return {k: vs[0] for k, vs in chosen.items()}
