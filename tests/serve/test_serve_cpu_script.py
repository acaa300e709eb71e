"""benchmarks/serve_cpu.py helpers: the int8 artifact check and the per-target CPU accounting."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _bench import load_benchmark

pytest.importorskip("psutil")


@pytest.fixture(scope="module")
def serve_cpu():
    return load_benchmark("serve_cpu", module_name="serve_cpu_under_test")


def _artifact(tmp: Path, recipe: str, reason: str = "") -> str:
    tmp.mkdir()
    (tmp / "manifest.json").write_text(json.dumps({"recipe": recipe}))
    (tmp / "report.json").write_text(json.dumps({"chosen": recipe, "candidates": [
        {"recipe": "eager", "status": "chosen" if recipe == "eager" else "ok", "reason": ""},
        {"recipe": "bert-unpad-int8", "status": "failed" if reason else "chosen", "reason": reason}]}))
    return str(tmp)


def test_an_artifact_that_fell_back_to_eager_is_refused_with_the_reason(serve_cpu, tmp_path):
    ok = _artifact(tmp_path / "int8", "bert-unpad-int8")
    assert serve_cpu.check_int8_artifact(ok) == ok
    eager = _artifact(tmp_path / "eager", "eager", "ran past its 120 s limit")
    with pytest.raises(RuntimeError, match=r"holds recipe 'eager', expected 'bert-unpad-int8' "
                                           r"\(bert-unpad-int8: failed, ran past its 120 s limit\)"):
        serve_cpu.check_int8_artifact(eager)
    with pytest.raises(RuntimeError, match="no manifest.json"):
        serve_cpu.check_int8_artifact(str(tmp_path))


def test_cpu_is_charged_to_the_target_whose_burst_it_is(serve_cpu):
    focused: list[str | None] = []
    me = SimpleNamespace(pid=os.getpid())  # a stand-in server: this process (no children)
    meter = serve_cpu.CpuMeter({"a": (me, "", ""), "b floor": (me, "", "")}, {"b": "b floor"}, focused.append)

    def burn(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    meter("a")
    burn(0.05)
    meter("b")  # loads the server of "b floor"
    burn(0.02)
    meter(None)
    burn(0.3)  # between bursts: charged to nobody
    assert focused == ["a", "b", None]
    client_a, server_a, workers_a = meter.cpu["a"]
    client_b = meter.cpu["b"][0]
    assert 0.05 <= client_a < 0.3 and 0.02 <= client_b < 0.3  # CPU seconds, not wall time
    # the stand-in server is this process, read from /proc in 10 ms clock ticks: 0.05 s reads 0.04-0.06
    assert 0.03 <= server_a < 0.3 and workers_a == 0.0
    per = meter.per_request_us({"a": SimpleNamespace(sent=100), "b": SimpleNamespace(sent=0)})
    assert per["a"]["client"] == pytest.approx(client_a / 100 * 1e6)
    assert per["b"]["client"] == pytest.approx(client_b * 1e6)  # nothing sent: divided by 1, not 0
