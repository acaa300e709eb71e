"""The report's content: every column, JSON/Markdown round trip, statuses and reasons."""

from __future__ import annotations

import json

import torchnitro
from torchnitro.autotune.report import Report


def test_report_content(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = torchnitro.optimize(fr.tiny_model(), fr.tiny_inputs(), fast_cfg(recipes=["test-raises", "test-wrong",
                                                                                 "torchscript", "conv-bn-fold"]))
    rep = opt.report
    assert [c.recipe for c in rep.candidates] == ["eager", "torchscript", "conv-bn-fold", "test-raises", "test-wrong"]
    statuses = {c.recipe: c.status for c in rep.candidates}
    assert statuses["test-raises"] == "failed" and statuses["test-wrong"] == "rejected"
    assert statuses["conv-bn-fold"] == "skipped" and "no Conv" in rep.get("conv-bn-fold").reason
    assert statuses[opt.recipe] == "chosen" and list(statuses.values()).count("chosen") == 1
    eager = rep.get("eager")
    for field in ("p50_ms", "p99_ms", "throughput", "speedup", "build_s", "norm_rel", "min_cosine"):
        assert getattr(eager, field) is not None, field
    assert rep.objective == "latency p50 on float32[4x16]"
    assert "cores" in rep.hardware and rep.model == "Sequential" and rep.inputs == "float32[4x16]"
    md = rep.to_markdown()
    for col in ("recipe", "status", "p50 ms", "p99 ms", "items/s", "speedup", "mem MB", "rel err", "min cos", "build s"):
        assert col in md
    assert "boom from test-raises" in md and "objective: latency p50" in md
    back = Report.from_dict(json.loads(rep.to_json()))
    assert back.to_markdown() == md
    assert "test-wrong" in str(rep)


def test_peak_memory_sees_a_transient_allocation(fake_recipes, fast_cfg):
    fr = fake_recipes
    opt = torchnitro.optimize(fr.tiny_model(), fr.tiny_inputs(), fast_cfg(recipes=["test-hog"]))
    assert opt.report.get("test-hog").peak_mem_mb > 128
    assert opt.report.get("eager").peak_mem_mb < 128
