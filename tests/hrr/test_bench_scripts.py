"""benchmarks/hrr_repeat.py runs end to end (tiny grid, short timings) on the candidates of hrr.py."""

from __future__ import annotations

import json

import pytest
import torch
from _bench import load_benchmark


def test_repeat_script_reports_every_round(tmp_path, monkeypatch):
    pytest.importorskip("torchhd", reason="torch-hd (the bench extra) is not installed")
    tool = load_benchmark("hrr_repeat")
    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path))
    before = torch.get_num_threads()
    try:
        assert tool.main(["--repeats", "3", "--dims", "32", "--batches", "2", "5", "--min-time", "0.005",
                          "--max-time", "0.05", "--name", "r"]) == 0
    finally:
        torch.set_num_threads(before)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["op"], r["batch"]) for r in rows] == [("bind", 2), ("bind", 5), ("unbind", 2), ("unbind", 5)]
    for r in rows:
        xs = [float(x) for x in r["every_round"].split()]
        assert len(xs) == 3 and r["min_x"] <= r["median_x"] <= r["max_x"]
        assert r["rounds_at_2x"] == f"{sum(x >= 2 for x in xs)}/3"
