"""Search-time timing on a busy machine says so: eager's in-process search-time p50 was inflated hundreds of times
under load (2 torch threads on 2 cores at load 8) and every ``~`` estimate against it was meaningless, unmarked."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import torchnitro.autotune.evaluate as ev_mod
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.autotune.report import BUSY_NOTE, CandidateResult, Report, Status
from torchnitro.bench.timing import TimingConfig
from torchnitro.hardware import hardware_info


def _evaluate(tmp_path, monkeypatch, delays_ns):
    """Evaluate eager in this process with the run-queue delay readings replaced by ``delays_ns`` (cumulative)."""
    readings = itertools.chain(delays_ns, itertools.repeat(delays_ns[-1]))
    monkeypatch.setattr(ev_mod, "_run_queue_delay_ns", lambda: next(readings))
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    ctx = BuildContext(nn.Linear(8, 4).eval(), (x,), hardware_info(), torch.device("cpu"), tmp_path)
    timing = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=0.001, max_time_s=0.05, device="cpu")
    return ev_mod.evaluate(get_recipe("eager"), ctx, [(x,)], [(x,)], timing, items_per_call=2)


def test_a_measurement_whose_threads_waited_for_a_cpu_is_marked(tmp_path, monkeypatch):
    ev = _evaluate(tmp_path, monkeypatch, [0, 10**15])  # waited far longer than the measurement lasted
    assert BUSY_NOTE in ev.notes and "search-time timing is unreliable" in ev.notes, ev.notes


def test_a_quiet_measurement_is_not_marked(tmp_path, monkeypatch):
    ev = _evaluate(tmp_path, monkeypatch, [5 * 10**9, 5 * 10**9])  # no wait during the measurement
    assert BUSY_NOTE not in ev.notes


@pytest.mark.parametrize("busy, want", [
    ("eager", "eager's search-time p50, the baseline of every one"),
    ("bf16", "search-time estimates (~) of bf16 unreliable"),
    (None, None),
])
def test_the_report_says_which_estimates_a_busy_machine_spoiled(busy, want):
    note = f"{BUSY_NOTE}: its 2 torch thread(s) waited for a CPU 71% of the measurement's wall time"
    rep = Report(model="m", inputs="x", objective="o", hardware="h", chosen="torchscript", candidates=[
        CandidateResult("eager", "exact", Status.VERIFIED, p50_ms=1.1, speedup=1.0, interleaved=True,
                        notes=note if busy == "eager" else ""),
        CandidateResult("torchscript", "exact", Status.CHOSEN, p50_ms=0.4, speedup=2.9, interleaved=True),
        CandidateResult("bf16", "reduced", Status.VERIFIED, p50_ms=880.0, speedup=0.01,
                        notes=note if busy == "bf16" else ""),
    ])
    md = rep.to_markdown()
    if want is None:
        assert "unreliable" not in md
    else:
        assert want in md and BUSY_NOTE in md, md
