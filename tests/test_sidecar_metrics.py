"""The sidecar's lock-free loop metrics expose exactly what prometheus_client's own types expose."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sidecar.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text format's lines, less the `_created` series that only prometheus_client's types add."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["1", "2"]),
                                 st.floats(0, 20, allow_nan=False) | st.sampled_from(LATENCY_BUCKETS)),
                       max_size=40))  # fmt: skip
def test_loop_metrics_expose_what_prometheus_client_exposes(events: list[tuple[str, str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = LoopCounter("t_requests", "Requests.", ["model", "version"], registry=ours)
    h1 = LoopHistogram("t_seconds", "Latency.", ["model", "version"], LATENCY_BUCKETS, registry=ours)
    c2 = Counter("t_requests", "Requests.", ["model", "version"], registry=theirs)
    h2 = Histogram("t_seconds", "Latency.", ["model", "version"], buckets=LATENCY_BUCKETS, registry=theirs)
    for model, version, seconds in events:  # bucket bounds themselves included: `le` is inclusive
        c1.labels(model, version).inc()
        c2.labels(model, version).inc()
        h1.labels(model, version).observe(seconds)
        h2.labels(model, version).observe(seconds)
    assert exposition(ours) == exposition(theirs)
    for model, version, _ in events:
        labels = {"model": model, "version": version}
        assert ours.get_sample_value("t_seconds_count", labels) == theirs.get_sample_value(
            "t_seconds_count", labels
        )


def test_loop_metrics_check_their_labels_and_names() -> None:
    registry = CollectorRegistry()
    c = LoopCounter("t_total_things", "Things.", ["model"], registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        c.labels("m", "extra")
    c.labels(2).inc()  # label values become strings, as prometheus_client makes them
    c.labels("2").inc()
    assert registry.get_sample_value("t_total_things_total", {"model": "2"}) == 2.0
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopCounter("t_total_things", "Things again.", ["model"], registry=registry)
