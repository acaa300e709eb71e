"""benchmarks/timing_fairness.py runs end to end (one tiny workload, TorchScript only, one round between two alone
sets, the allocator and thread tables off: tests/bench/test_timing_fairness_tables.py covers them, and the chain of
blocks) and writes its tables: every round's numbers, the goals computed from them, the round with the probe."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the timing children import the script by name
    spec = importlib.util.spec_from_file_location("timing_fairness", ROOT / "benchmarks" / "timing_fairness.py")
    tf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "timing_fairness", tf)
    spec.loader.exec_module(tf)
    return tf


def _close(a: float, b: float) -> bool:
    """Equal up to the tables' rounding: 4 significant digits of each time, 0.1% of each printed difference."""
    return abs(a - b) <= 1e-3 + 2e-3 * (1 + abs(b))


def _nums(text: str) -> list[float]:
    return [math.nan if x == "-" else float(x.rstrip("%")) / (100 if x.endswith("%") else 1) for x in text.split("/")]


def test_timing_fairness_quick_end_to_end(tmp_path, monkeypatch):
    tf = _load_script(monkeypatch)
    monkeypatch.setattr(tf, "QUICK_WORKLOADS", {"mlp": ("mlp", 2, 0)})
    monkeypatch.setattr(tf, "FAMILIES", {"torchscript": "torchscript"})
    monkeypatch.setattr(tf, "QUICK_FINAL_S", 0.05)  # enough samples of a ~0.1 ms call; the numbers are not judged
    monkeypatch.setattr(tf, "QUICK_PROBE_S", 0.05)
    assert tf.main(["--quick", "--rounds", "1", "--no-allocator", "--no-threads", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "timing_fairness_quick.json").read_text())
    assert set(data) == {"variants", "speedups", "rounds"}
    for key, cols in (("variants", tf.VARIANT_COLUMNS), ("speedups", tf.SPEEDUP_COLUMNS), ("rounds", tf.ROUND_COLUMNS)):
        assert data[key]["columns"] == list(cols)
        assert all(set(r) == set(cols) for r in data[key]["rows"]), data[key]["rows"]
    rows = data["variants"]["rows"]
    assert [r["variant"] for r in rows] == ["eager", "torchscript"]
    alone = {}
    for r in rows:  # every round's numbers; the medians and the goal come from them
        inside, alone[r["variant"]], diff = (_nums(r[c]) for c in ("in comparison per round ms", "alone per round ms",
                                                                   "diff per round"))
        assert len(inside) == len(alone[r["variant"]]) == len(diff) == 1 and all(x > 0 for x in inside), r
        sets = _nums(r["alone sets per round ms"].replace("|", "/"))  # the alone sets before and after the round
        assert len(sets) == 2 and _close(alone[r["variant"]][0], statistics.fmean(sets)), r
        assert abs(r["p50 in comparison ms"] - statistics.median(inside)) <= 1e-3 * r["p50 in comparison ms"], r
        assert abs(r["p50 alone ms"] - statistics.median(alone[r["variant"]])) <= 1e-3 * r["p50 alone ms"], r
        want = [a / b - 1 for a, b in zip(inside, alone[r["variant"]])]
        assert all(_close(d, w) for d, w in zip(diff, want)), (diff, want)
        med = _nums(r["diff"])[0]
        assert _close(med, statistics.median(want)), r
        if abs(abs(med) - tf.P50_GOAL) > 2e-3:  # the rounded text cannot decide a case at the boundary
            assert r["within 5%"] is (abs(med) <= tf.P50_GOAL), r
        assert r["timed in comparison"].startswith("own process"), r
    assert [r["alone"] for r in rows] == ["built-in rebuilt from its factory", "artifact (torchnitro.load)"]
    (sp,) = data["speedups"]["rows"]
    reported, iso, diff = (_nums(sp[c]) for c in ("reported per round", "isolated per round", "diff per round"))
    assert len(reported) == 1 and all(x > 0 for x in reported), sp
    assert all(_close(i, e / t) for i, e, t in zip(iso, alone["eager"], alone["torchscript"])), sp
    med = statistics.median([a / b - 1 for a, b in zip(reported, iso)])
    assert _close(_nums(sp["diff"])[0], med), sp
    if abs(abs(med) - tf.SPEEDUP_GOAL) > 3e-3:
        assert sp["within 10%"] is (abs(med) <= tf.SPEEDUP_GOAL), sp
    # the round: its comparison between two alone sets, the probe read around them
    rounds = data["rounds"]["rows"]
    assert [(r["round"], r["blocks"]) for r in rounds] == [(1, "alone set 0, comparison, alone set 1")]
    assert all(r["probe at start ms"] > 0 and r["probe at end ms"] > 0 and r["comparison s"] > 0
               and all(x > 0 for x in _nums(r["alone s"])) for r in rounds), rounds
    assert all(len(_nums(r["eager per process ms"])) == 1 for r in rounds), rounds
    chosen = [str(r["round"]) for r in rounds if r["chosen"] == "torchscript"]
    assert sp["chosen in rounds"] == ("/".join(chosen) or "none")
    meta = data["variants"]["meta"]
    notes = meta["notes"]
    # the round re-ran the comparison on the cached candidates (the whole-search entry of the building search removed,
    # nothing built again), and no artifact was rebuilt
    assert [n.split(":")[0] for n in notes if " comparison: chosen" in n] == ["mlp round 1 of 1 comparison"], notes
    assert not any("built again" in n or "rebuilt in its child" in n or "machine-speed probe:" in n
                   for n in notes), notes
    assert "torch" in meta["versions"] and meta["machine"] and "allocator" in meta["timing environment"]
    assert meta["commit"]  # the checkout the numbers came from (git_commit: a hash or "unknown (not a git checkout)")
    assert "--quick" in meta["command"] and meta["rounds"].startswith("1 per workload")
    assert "CPUs" in meta["load average at start"] and "CPUs" in meta["load average at end"]
    md = (tmp_path / "timing_fairness_quick.md").read_text()
    assert "isolated ratio" in md and "probe at start ms" in md and "diff per round" in md
