"""benchmarks/timing_fairness.py runs end to end (one tiny workload, TorchScript only) and writes its tables;
the optimizer's comparison timed eager and TorchScript each in its own process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_timing_fairness_quick_writes_both_tables(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the timing children import the script by name
    spec = importlib.util.spec_from_file_location("timing_fairness", ROOT / "benchmarks" / "timing_fairness.py")
    tf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "timing_fairness", tf)
    spec.loader.exec_module(tf)
    monkeypatch.setattr(tf, "QUICK_WORKLOADS", {"mlp": ("mlp", 2, 0)})
    monkeypatch.setattr(tf, "FAMILIES", {"torchscript": "torchscript"})
    # each table row is one fresh timing process: keep the baseline row and one other of each table (the allocator
    # table's last row is the mallopt-after-start one asserted below); the rows left out differ only in env values
    monkeypatch.setattr(tf, "MALLOC_SETTINGS", {k: tf.MALLOC_SETTINGS[k] for k in list(tf.MALLOC_SETTINGS)[::3]})
    monkeypatch.setattr(tf, "THREAD_SETTINGS", dict(list(tf.THREAD_SETTINGS.items())[::3]))
    assert tf.main(["--quick", "--repeat", "2", "--eager-processes", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "timing_fairness_quick.json").read_text())
    rows = data["variants"]["rows"]
    assert [r["variant"] for r in rows] == ["eager", "torchscript"]
    assert all(r["p50 in comparison ms"] > 0 and r["p50 alone ms"] > 0 for r in rows)
    # the alone side: two independent sets of fresh processes, p50 alone their median (of two: the mean)
    for r in rows:
        per = [float(x) for x in r["alone per process ms"].split("/")]
        assert len(per) == 2 and abs(r["p50 alone ms"] - sum(per) / 2) < 0.01 * max(per), r
    # eager too, in three processes (eager_processes): "p50 in comparison" is the optimizer's median of theirs
    assert [r["timed in comparison"].split(",")[0] for r in rows] == ["3 own processes", "own process"]
    inside = [float(x) for x in rows[0]["comparison per process ms"].split("/")]
    assert len(inside) == 3 and abs(rows[0]["p50 in comparison ms"] - sorted(inside)[1]) < 0.006, rows[0]
    assert len(rows[1]["comparison per process ms"].split("/")) == 1
    assert data["variants"]["meta"]["eager in the comparison"].startswith("3 fresh processes")
    # the alone side times the artifact the optimizer saved, as torchnitro.load runs it (not a rebuild)
    assert [r["alone"] for r in rows] == ["built-in rebuilt from its factory", "artifact (torchnitro.load)"]
    assert [r["variant"] for r in data["speedups"]["rows"]] == ["torchscript"]
    meta = data["variants"]["meta"]
    assert not any("rebuilt in its child" in n for n in meta["notes"]), meta["notes"]
    assert "torch" in meta["versions"] and meta["machine"] and "allocator" in meta["timing environment"]
    assert "--quick" in meta["command"]
    assert "CPUs" in meta["load average at start"] and "CPUs" in meta["load average at end"]
    assert "isolated ratio" in (tmp_path / "timing_fairness_quick.md").read_text()
    settings = [r["setting"] for r in data["allocator"]["rows"]]
    assert settings == list(tf.MALLOC_SETTINGS) and all(r["eager p50 alone ms"] > 0 for r in data["allocator"]["rows"])
    assert data["allocator"]["rows"][-1]["env"].startswith("mallopt MALLOC_MMAP_THRESHOLD_=268435456")
    # the OpenMP wait table: each setting quiet and beside one busy process, each against libgomp's default
    threads = data["threads"]["rows"]
    assert [(r["beside"], r["setting"]) for r in threads] == [
        (b, s) for b in ("nothing", "one busy process") for s in tf.THREAD_SETTINGS], threads
    assert all(r["eager p50 alone ms"] > 0 for r in threads)
    assert threads[0]["vs libgomp default, same load"] == pytest.approx(1.0)
