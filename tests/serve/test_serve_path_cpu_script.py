"""benchmarks/serve_path_cpu.py: a short run answers every request, in batches, and counts CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_path_cpu.py"


def test_short_run_batches_and_answers_every_request(capsys):
    spec = importlib.util.spec_from_file_location("serve_path_cpu_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--requests", "96", "--warmup", "32", "--concurrency", "8", "--batch", "8"])
    assert res["errors"] == 0 and res["requests"] >= 96
    assert 1 < res["mean_batch"] <= 8  # requests were batched, never beyond the limit
    assert res["cpu_us_per_request"] > 0
    assert "us CPU per request" in capsys.readouterr().out
