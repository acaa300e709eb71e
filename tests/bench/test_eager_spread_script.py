"""benchmarks/eager_spread.py runs end to end (--quick: mlp, one fresh process per allocator setting) and writes its
tables and plot; each process's row carries its page faults per call (nothing timed is asserted)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator settings compared are glibc's")
def test_eager_spread_quick_writes_both_settings_with_their_page_faults(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eager_spread.py"), "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "eager_spread_quick.json").read_text())
    rows = data["processes"]["rows"]
    assert [(r["workload"], r["setting"]) for r in rows] == [("mlp", "glibc defaults"), ("mlp", "allocator setting")]
    for r in rows:
        assert r["p10 ms"] <= r["p50 ms"] <= r["p90 ms"] and r["p10 ms"] > 0
        assert r["page faults per call"] >= 0
    assert [r["setting"] for r in data["summary"]["rows"]] == ["glibc defaults", "allocator setting"]
    assert "MALLOC_MMAP_THRESHOLD_=268435456" in data["processes"]["meta"]["settings"]["allocator setting"]
    md = (tmp_path / "eager_spread_quick.md").read_text()
    assert "how far fresh processes differ" in md and (tmp_path / "eager_spread_quick.png").stat().st_size > 5000
