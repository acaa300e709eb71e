"""metrics.Tally: per-request observations counted without prometheus_client's locks, added on render."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: E402

from torchnitro.serve.metrics import ServeMetrics, Tally  # noqa: E402

_VALUES = [0.0, 0.0004, 0.0005, 0.0007, 0.003, 0.05, 0.05, 1.5, 9.9, 10.0, 12.0, 1e9]


def _samples(h: Histogram) -> list[tuple[str, dict, float]]:
    return [(s.name, s.labels, s.value) for m in h.collect() for s in m.samples if not s.name.endswith("_created")]


@pytest.mark.parametrize("fallback", [False, True])
def test_tally_gives_the_same_histogram_as_observe(fallback):
    reg = CollectorRegistry()
    buckets = (0.0005, 0.001, 0.05, 1.0, 10.0)
    direct = Histogram("direct", "d", ["model"], buckets=buckets, registry=reg)
    tallied = Histogram("tallied", "t", ["model"], buckets=buckets, registry=reg)
    for v in _VALUES:
        direct.labels("m").observe(v)
    child = tallied.labels("m")
    t = Tally(child)
    if fallback:  # a prometheus_client without the bucket internals: values kept and observed on flush
        t = Tally(type("Child", (), {"observe": child.observe})())
        assert t.counts is None and t.values == []
    for v in _VALUES:
        t.observe(v)
    assert _samples(tallied) != _samples(direct)  # nothing reaches the metric before a flush
    t.flush()
    assert [(n.replace("tallied", "direct"), lab, v) for n, lab, v in _samples(tallied)] == _samples(direct)
    t.flush()  # a second flush adds nothing
    assert [(n.replace("tallied", "direct"), lab, v) for n, lab, v in _samples(tallied)] == _samples(direct)


def test_counter_tally_and_render_flush():
    m = ServeMetrics()
    c = m.tally(m.requests.labels("mlp", "200"), counter=True)
    q = m.tally(m.queue.labels("mlp"))
    for _ in range(3):
        c.inc()
        q.observe(0.003)
    text = m.render().decode()
    assert 'torchnitro_requests_total{code="200",model="mlp"} 3.0' in text
    assert 'torchnitro_queue_seconds_count{model="mlp"} 3.0' in text
    assert 'torchnitro_queue_seconds_bucket{le="0.005",model="mlp"} 3.0' in text
    assert 'torchnitro_queue_seconds_bucket{le="0.002",model="mlp"} 0.0' in text
    c.inc(2)
    assert 'torchnitro_requests_total{code="200",model="mlp"} 5.0' in m.render().decode()
