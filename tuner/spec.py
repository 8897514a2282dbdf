"""Tuning specs: the TOML file that fixes model, reference, inputs, tolerance, objective and search before any result.

Validated once, where it enters (`load_spec`); everything below works on the frozen `TuneSpec`.
Relative paths are resolved against the spec file's directory. `spec.raw` is the spec as loaded
(what release.json records) and `spec.digest` its sha256 (what the cache resumes against).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunegate import models, validate
from tunegate.errors import InputError
from tunegate.stats import samples_to_show_below
from tunegate.tolerance import ToleranceError, ToleranceSpec

STRATEGIES = ("fast", "full", "mixed", "halving")
OBJECTIVE_METRICS = ("p50", "p95", "throughput")
VALUE_KINDS = ("text", "normal", "uniform")
INPUT_SOURCES = ("declared", "capture")
DEMO_SOURCES = ("demo:minilm", "demo:tiny")  # the demo models' ONNX in the tunegate cache


class SpecError(InputError):
    """A tuning spec that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    name: str
    source: Path  # the source ONNX
    repository: Path


@dataclasses.dataclass(frozen=True)
class ReferenceSection:
    implementation: str = "onnxruntime"
    precision: str = "fp32"
    graph_optimization_level: str = "disable"
    intra_op_num_threads: int = 1


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    sequence: int | None
    weight: float


@dataclasses.dataclass(frozen=True)
class InputsSection:
    source: str = "declared"
    capture: Path | None = None
    values: str = "normal"  # text | normal | uniform (declared inputs)
    shapes: tuple[Shape, ...] = (Shape(1, None, 1.0),)
    edge_cases: bool = True
    seed: int = 0
    mean: float = 0.0
    std: float = 1.0
    max_length: int = 128


@dataclasses.dataclass(frozen=True)
class GateSection:
    """The gate in the canary's terms: each gate request is one sample, judged by `[tolerance]` on its own.

    A route passes when the anytime-valid upper bound (tunegate.stats.rate_bounds, the bound the
    sidecar's judge uses) of its out-of-tolerance rate is at most `oot_budget`, and every pooled
    `checks` tolerance (worst sample, quantile over all gate rows) holds too.
    """

    oot_budget: float = 0.005  # the sidecar canary's default
    confidence: float = 0.99
    samples: int = 0  # gate requests (captured, or drawn plus the edge cases); 0 = the fewest that can pass
    checks: ToleranceSpec | None = None

    @property
    def needed(self) -> int:
        """The fewest samples whose bound, with no request out of tolerance, is within the budget."""
        return samples_needed(self.oot_budget, self.confidence)


def samples_needed(budget: float, confidence: float) -> int:

    return samples_to_show_below(budget, confidence)


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    metric: str = "p50"
    batch_sizes: tuple[int, ...] = ()  # () = every shape of the distribution
    min_speedup: float = 1.05  # a winner must beat the baseline by at least this factor ...
    confidence: float = 0.95  # ... shown by the paired lower bound of its speedup at this confidence


@dataclasses.dataclass(frozen=True)
class BenchSection:
    warmup: int = 3
    repeats: int = 20
    cheap_repeats: int = 5  # halving's first round
    bootstrap: int = 1000
    e2e: bool = True  # finalists end to end through the embedded Triton
    e2e_concurrency: int = 2
    e2e_requests: int = 32


@dataclasses.dataclass(frozen=True)
class SearchSection:
    backend: str = "onnxruntime"
    routes: str = ""
    strategy: str = "fast"
    budget_s: float = 600.0
    build_timeout_s: float = 600.0
    finalists: int = 2
    halving_keep: float = 0.34  # fraction of routes halving benchmarks again, longer
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # builder-specific


@dataclasses.dataclass(frozen=True)
class ServingSection:
    """Serving-configuration routes (tuner.serving): Triton's own knobs, measured on the real Triton."""

    routes: str = ""  # e.g. "-instances=[1|2] -max_batch=[0|16] -queue_us=[off|500]"; "" = no serving search
    strategy: str = "full"  # full | fast
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    latency_ms: float = (
        0.0  # the objective: throughput with p95 within this; 0 = best throughput at any latency
    )
    window_ms: int = 3000  # how long each concurrency level is measured
    rounds: int = 3  # each round measures every route, the model's own configuration first
    min_gain: float = 1.1  # the median of the rounds' throughput ratios must reach this, every round above 1
    requests: int = 256  # captured requests replayed (perf_analyzer --input-data), from the gate's


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    path: Path
    model: ModelSection
    reference: ReferenceSection
    inputs: InputsSection
    tolerance: ToleranceSpec
    gate: GateSection
    objective: ObjectiveSection
    bench: BenchSection
    search: SearchSection
    workdir: Path
    raw: Mapping[str, Any]
    digest: str
    serving: ServingSection = ServingSection()

    def with_search(self, **changes: Any) -> TuneSpec:
        """A copy with search settings overridden from the command line (the digest stays the spec's)."""
        return dataclasses.replace(self, search=dataclasses.replace(self.search, **changes))


def _table(raw: Mapping[str, Any], key: str, where: str, required: bool = False) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        if required:
            raise SpecError(f"{where}: missing table [{key}]")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: [{key}] must be a table")
    return value


def _section(cls: type, table: Mapping[str, Any], where: str, **converted: Any) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise SpecError(f"{where}: unknown keys {unknown} (known: {sorted(fields)})")
    kwargs: dict[str, Any] = {}
    for name, value in table.items():
        if name in converted:
            continue
        default = fields[name].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise SpecError(f"{where}.{name}: expected true or false, got {value!r}")
        if isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SpecError(f"{where}.{name}: expected a number, got {value!r}")
            value = float(value)
        elif (
            isinstance(default, int)
            and not isinstance(default, bool)
            and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise SpecError(f"{where}.{name}: expected an integer, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise SpecError(f"{where}.{name}: expected a string, got {value!r}")
        kwargs[name] = value
    kwargs.update({k: v for k, v in converted.items() if k in table or v is not None})
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from exc


def _positive(where: str, value: float, *, allow_zero: bool = False) -> None:
    validate.positive(where, value, SpecError, allow_zero=allow_zero)


def _choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(f"{where} is {value!r}; expected one of {', '.join(choices)}")


def _path(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}: expected a path string")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _shapes(raw: Any, where: str) -> tuple[Shape, ...]:
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"{where}: expected a non-empty array of tables [[inputs.shapes]]")
    out = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{w}: expected a table with batch, sequence, weight")
        unknown = sorted(set(item) - {"batch", "sequence", "weight"})
        if unknown:
            raise SpecError(f"{w}: unknown keys {unknown}")
        batch, seq, weight = item.get("batch"), item.get("sequence"), item.get("weight", 1.0)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise SpecError(f"{w}.batch must be an integer >= 1, got {batch!r}")
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 1):
            raise SpecError(f"{w}.sequence must be an integer >= 1, got {seq!r}")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
            raise SpecError(f"{w}.weight must be a number > 0, got {weight!r}")
        out.append(Shape(batch, seq, float(weight)))
    return tuple(out)


def _resolve_source(base: Path, value: Any) -> Path:
    if value in DEMO_SOURCES:
        try:
            if value == "demo:tiny":
                path = models.cache_dir() / "tiny" / "model.onnx"
                return path if path.exists() else models.build_tiny(path)
            return models.minilm_onnx()
        except models.ModelError as exc:
            raise SpecError(f"[model].source {value}: {exc}") from exc
    p = _path(base, value, "[model].source")
    if not p.is_file():
        raise SpecError(f"[model].source: {p} does not exist")
    return p


def _gate(table: Mapping[str, Any], where: str) -> GateSection:
    body = dict(table)
    raw_checks = body.pop("checks", None)
    checks = None
    if raw_checks is not None:
        if not isinstance(raw_checks, Mapping):
            raise SpecError(
                f"{where}: [gate.checks] must be a table of output name -> {{metric, threshold, ...}}"
            )
        try:
            checks = ToleranceSpec.from_dict(raw_checks)
        except ToleranceError as exc:
            raise SpecError(f"{where}: [gate.checks]: {exc}") from exc
    gate: GateSection = _section(GateSection, body, f"{where}: [gate]")
    if not 0.0 < gate.oot_budget < 1.0:
        raise SpecError(f"{where}: [gate].oot_budget must be within (0, 1), got {gate.oot_budget}")
    if not 0.5 < gate.confidence < 1.0:
        raise SpecError(f"{where}: [gate].confidence must be within (0.5, 1), got {gate.confidence}")
    needed = gate.needed
    if "samples" not in body:
        return dataclasses.replace(gate, samples=needed, checks=checks)
    if gate.samples < needed:
        raise SpecError(
            f"{where}: [gate].samples = {gate.samples} cannot pass: with no request out of tolerance, the "
            f"upper bound of the rate at {gate.confidence:g} confidence reaches oot_budget = {gate.oot_budget:g} "
            f"only from {needed} samples; set samples >= {needed} (more leave room for a few failures)"
        )
    return dataclasses.replace(gate, checks=checks)


def parse_spec(raw: Mapping[str, Any], path: Path) -> TuneSpec:
    """Validate a loaded TOML document (exposed for tests); `path` anchors relative paths."""
    where = str(path)
    base = path.parent.resolve()
    known = {
        "model",
        "reference",
        "inputs",
        "tolerance",
        "gate",
        "objective",
        "bench",
        "search",
        "serving",
        "output",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpecError(f"{where}: unknown tables {unknown} (known: {sorted(known)})")

    m = _table(raw, "model", where, required=True)
    if sorted(set(m) - {"name", "source", "repository"}):
        raise SpecError(
            f"{where}: [model] has unknown keys {sorted(set(m) - {'name', 'source', 'repository'})}"
        )
    for key in ("name", "source", "repository"):
        if key not in m:
            raise SpecError(f"{where}: [model].{key} is required")
    if not isinstance(m["name"], str) or not m["name"] or "/" in m["name"]:
        raise SpecError(f"{where}: [model].name must be a non-empty name without '/'")
    model = ModelSection(
        m["name"], _resolve_source(base, m["source"]), _path(base, m["repository"], "[model].repository")
    )

    reference = _section(ReferenceSection, _table(raw, "reference", where), f"{where}: [reference]")
    _choice("[reference].implementation", reference.implementation, ("onnxruntime",))
    _choice("[reference].precision", reference.precision, ("fp32",))
    _choice(
        "[reference].graph_optimization_level",
        reference.graph_optimization_level,
        ("disable", "basic", "extended", "all"),
    )
    _positive("[reference].intra_op_num_threads", reference.intra_op_num_threads)

    it = _table(raw, "inputs", where)
    if "batches" in it:
        raise SpecError(
            f"{where}: [inputs].batches is now [gate].samples: each gate request is one sample of the "
            "out-of-tolerance rate the gate bounds, as each live request is for the canary"
        )
    shapes = _shapes(it["shapes"], "[inputs].shapes") if "shapes" in it else None
    capture = _path(base, it["capture"], "[inputs].capture") if "capture" in it else None
    inputs = _section(InputsSection, it, f"{where}: [inputs]", shapes=shapes, capture=capture)
    _choice("[inputs].source", inputs.source, INPUT_SOURCES)
    _choice("[inputs].values", inputs.values, VALUE_KINDS)
    if inputs.source == "capture" and inputs.capture is None:
        raise SpecError(f"{where}: [inputs].source = 'capture' needs [inputs].capture (a file or directory)")
    _positive("[inputs].max_length", inputs.max_length)

    try:
        tolerance = ToleranceSpec.from_dict(_table(raw, "tolerance", where, required=True))
    except ToleranceError as exc:
        raise SpecError(f"{where}: [tolerance]: {exc}") from exc
    gate = _gate(_table(raw, "gate", where), where)

    ob = _table(raw, "objective", where)
    bs = ob.get("batch_sizes")
    if bs is not None and (not isinstance(bs, list) or not all(isinstance(b, int) and b >= 1 for b in bs)):
        raise SpecError(f"{where}: [objective].batch_sizes must be an array of integers >= 1")
    objective = _section(ObjectiveSection, ob, f"{where}: [objective]", batch_sizes=tuple(bs) if bs else None)
    _choice("[objective].metric", objective.metric, OBJECTIVE_METRICS)
    _positive("[objective].min_speedup", objective.min_speedup)
    if not 0.5 <= objective.confidence < 1.0:
        raise SpecError(
            f"{where}: [objective].confidence must be within [0.5, 1), got {objective.confidence}"
        )
    declared_batches = {s.batch for s in inputs.shapes}
    missing = sorted(set(objective.batch_sizes) - declared_batches) if inputs.source == "declared" else []
    if missing:
        raise SpecError(
            f"{where}: [objective].batch_sizes {missing} are not batch sizes of [[inputs.shapes]]"
        )

    bench = _section(BenchSection, _table(raw, "bench", where), f"{where}: [bench]")
    for key in ("repeats", "cheap_repeats", "bootstrap", "e2e_concurrency", "e2e_requests"):
        _positive(f"[bench].{key}", getattr(bench, key))
    _positive("[bench].warmup", bench.warmup, allow_zero=True)

    se = dict(_table(raw, "search", where))
    options = se.pop("options", {})
    if not isinstance(options, Mapping):
        raise SpecError(f"{where}: [search.options] must be a table")
    search = _section(SearchSection, se, f"{where}: [search]")
    search = dataclasses.replace(search, options=dict(options))
    _choice("[search].strategy", search.strategy, STRATEGIES)
    for key in ("budget_s", "build_timeout_s"):
        _positive(f"[search].{key}", getattr(search, key))
    _positive("[search].finalists", search.finalists)
    if not 0 < search.halving_keep < 1:
        raise SpecError(f"{where}: [search].halving_keep must be within (0, 1)")

    sv = _table(raw, "serving", where)
    conc = sv.get("concurrency")
    if conc is not None and (
        not isinstance(conc, list) or not conc or not all(isinstance(c, int) and 1 <= c <= 1024 for c in conc)
    ):
        raise SpecError(
            f"{where}: [serving].concurrency must be a non-empty array of integers within 1..1024"
        )
    serving = _section(ServingSection, sv, f"{where}: [serving]", concurrency=tuple(conc) if conc else None)
    if conc:
        serving = dataclasses.replace(serving, concurrency=tuple(sorted(set(conc))))
    _choice("[serving].strategy", serving.strategy, ("full", "fast"))
    _positive("[serving].latency_ms", serving.latency_ms, allow_zero=True)
    for key in ("window_ms", "rounds", "min_gain", "requests"):
        _positive(f"[serving].{key}", getattr(serving, key))

    out = _table(raw, "output", where)
    if sorted(set(out) - {"workdir"}):
        raise SpecError(f"{where}: [output] has unknown keys {sorted(set(out) - {'workdir'})}")
    workdir = (
        _path(base, out["workdir"], "[output].workdir")
        if "workdir" in out
        else model.repository.parent / ".tunegate" / "tune" / path.stem
    )
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    return TuneSpec(
        path,
        model,
        reference,
        inputs,
        tolerance,
        gate,
        objective,
        bench,
        search,
        workdir,
        raw,
        digest,
        serving,
    )


def load_spec(path: str | Path) -> TuneSpec:
    """Read and validate a TOML tuning spec; raises SpecError with the file and key on anything wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such spec file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the spec ({exc})") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from exc
    return parse_spec(raw, path)
