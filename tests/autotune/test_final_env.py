"""The optimizer's final comparison starts every timing process with the OpenMP wait setting a deployed process
has (nothing added) and its report says so."""

from __future__ import annotations

import torchnitro
from torchnitro.autotune import fair, fair_place
from torchnitro.bench.isolated import ChildTimer


def test_final_comparison_children_run_libgomps_default_wait_and_the_report_says_so(fake_recipes, fast_cfg,
                                                                                     monkeypatch):
    import fake_standalone as fs

    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    started: list[ChildTimer] = []

    class Recorded(ChildTimer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

    monkeypatch.setattr(fair, "ChildTimer", Recorded)
    monkeypatch.setattr(fair_place, "ChildTimer", Recorded)
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True))
    assert opt.report.get("eager").alone and opt.report.get("test-faster").alone
    assert len(started) >= 2  # eager's process and the candidate's
    assert all(t.env == {} for t in started), [t.env for t in started]  # the deployed setting: nothing added
    env_notes = [n for n in opt.report.notes if n.startswith("timing environment:")]
    assert env_notes and env_notes[0].endswith("timing processes run libgomp's default OpenMP wait (nothing added)")
    gate = [n for n in opt.report.notes if n.startswith("timing gate:")]
    assert gate and "retaken" in gate[0], opt.report.notes  # the report says how many samples were retaken
