"""Report rows say which speedups are estimates (``~``): a candidate screened out before the final comparison
showed its screen ratio unmarked, as if it came from the comparison (DeBERTa: ``openvino ... 64.10x ±59.18``
while openvino was not a finalist and eager's comparison p50 was 1.09 ms)."""

from __future__ import annotations

from torchnitro.autotune.report import CandidateResult, Report, Status


def _report() -> Report:
    rep = Report(model="m", inputs="x", objective="o", hardware="h", chosen="torchscript")
    rep.candidates = [
        CandidateResult("eager", "exact", Status.VERIFIED, p50_ms=1.09, speedup=1.0, interleaved=True),
        CandidateResult("torchscript", "exact", Status.CHOSEN, p50_ms=0.38, speedup=2.88, noise=0.16,
                        interleaved=True),
        CandidateResult("openvino", "exact", Status.VERIFIED, p50_ms=1.37, speedup=64.10, noise=59.18,
                        interleaved=True, screened=True),
        CandidateResult("bf16", "reduced", Status.VERIFIED, p50_ms=879.95, speedup=0.75),
    ]
    return rep


def test_a_screened_out_row_marks_its_speedup_as_an_estimate():
    rep = _report()
    speedup = {r[0]: r[6] for r in rep.rows()}
    assert speedup == {"eager": "1.00x", "torchscript": "2.88x ±0.16", "openvino": "~64.10x ±59.18",
                       "bf16": "~0.75x"}
    md = rep.to_markdown()
    assert "~ on openvino: screened out before the final comparison" in md
    assert "~64.10x" in str(rep)
    assert Report.from_dict(rep.to_dict()).rows() == rep.rows()  # report.json keeps the mark


def test_no_screen_legend_without_screened_rows():
    rep = _report()
    rep.candidates = [c for c in rep.candidates if not c.screened]
    assert "screened out" not in rep.to_markdown()


def test_the_screen_marks_the_candidates_it_drops(noisy_search):
    """End to end: the screen drops the two decoys (the ``noisy_search`` fixture); their rows carry the mark."""
    rep = noisy_search().report
    screened = [c.recipe for c in rep.candidates if c.screened]
    finalists = [c.recipe for c in rep.candidates if c.interleaved and not c.screened and c.recipe != "eager"]
    assert screened and rep.chosen not in screened and rep.chosen in finalists, (screened, finalists, rep.notes)
    assert all("screen" in rep.get(n).notes for n in screened)
    rows = {r[0]: r[6] for r in rep.rows()}
    assert all(rows[n].startswith("~") for n in screened), rows
    assert all(not rows[n].startswith("~") for n in finalists), rows
