"""benchmarks/host_overhead.py runs without a GPU: Triton launches stubbed and counted, our ops on their
planned fast path, a table written; the stubs are undone afterwards (nothing timed is asserted)."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark


def test_host_overhead_quick_counts_launches_and_restores_triton(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from torchnitro.kernels import _triton, dispatch

    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path))
    mod = load_benchmark("host_overhead", monkeypatch)
    run, devices = JITFunction.run, dispatch._TRITON_DEVICES
    try:
        assert mod.main(["--quick", "--name", "ho"]) == 0
    finally:
        _triton.clear_tuned_configs()
    assert JITFunction.run is run and dispatch._TRITON_DEVICES == devices
    rows = json.loads((tmp_path / "ho.json").read_text())["rows"]
    ours = {(r["op"], r["phase"]): r for r in rows if r["provider"] == "torchnitro"}
    assert ours[("rms_norm", "fwd")]["triton_launches"] == 1
    assert ours[("rms_norm", "fwd+bwd")]["triton_launches"] == 3  # forward, backward, partial sums
    assert ours[("layer_norm", "fwd+bwd")]["triton_launches"] == 3
    assert ours[("rope(q,k)", "fwd+bwd")]["triton_launches"] == 2
    assert all(r["host_us"] > 0 and r["aten_ops"] == 0 for r in ours.values())  # no ATen op besides allocations
