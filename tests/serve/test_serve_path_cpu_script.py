"""benchmarks/serve_path_cpu.py: a short run answers every request, in batches, and counts CPU."""

from __future__ import annotations

import pytest
from _bench import load_benchmark

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def test_short_run_batches_and_answers_every_request(capsys):
    mod = load_benchmark("serve_path_cpu", module_name="serve_path_cpu_under_test")
    res = mod.main(["--requests", "96", "--warmup", "32", "--concurrency", "8", "--batch", "8"])
    assert res["errors"] == 0 and res["requests"] >= 96
    assert 1 < res["mean_batch"] <= 8  # requests were batched, never beyond the limit
    assert res["cpu_us_per_request"] > 0
    assert "us CPU per request" in capsys.readouterr().out
