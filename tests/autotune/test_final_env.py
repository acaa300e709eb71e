"""The optimizer's final comparison starts every timing process with the OpenMP wait setting of
``bench.environment`` and its report names it."""

from __future__ import annotations

import torchnitro
from torchnitro.autotune import fair
from torchnitro.bench.environment import THREAD_SETTING
from torchnitro.bench.isolated import ChildTimer


def test_final_comparison_children_start_with_the_thread_setting_and_the_report_says_so(fake_recipes, fast_cfg,
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
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True))
    assert opt.report.get("eager").alone and opt.report.get("test-faster").alone
    assert len(started) >= 2  # eager's process and the candidate's
    assert all(t.env == THREAD_SETTING for t in started), [t.env for t in started]
    setting = " ".join(f"{k}={v}" for k, v in THREAD_SETTING.items())
    env_notes = [n for n in opt.report.notes if n.startswith("timing environment:")]
    assert env_notes and env_notes[0].endswith(f"timing processes started with {setting}")
