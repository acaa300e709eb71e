"""Whose fault a failed candidate is, for ``benchmarks/optimize_user_models.py`` and its tests.

A failure counts against torchnitro unless it is explained: ``classify`` says ``ours`` where the reason
shows one of our own faults (``coverage_models.OUR_FAULT``: a leaked traceback or tensor repr, pickling of
user classes, an AttributeError on our replacement modules, ...), ``external`` only where it matches a
narrow, named outside cause (an op a runtime's converter has no rule for, a model int8 cannot keep
within the gate), ``budget`` where the search ran out of time, and ``unexplained`` otherwise, which is
counted as ours until someone explains it. (Reading the reason for our own patterns only missed both of
the issue's real faults: OpenVINO children that could not deserialize the program we exported, and
the ONNX export of a SentenceTransformer that handed its feature dict over as keyword arguments.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from coverage_models import ours

__all__ = ["EXTERNAL", "Verdict", "classify", "faults"]

# (pattern, why it is not torchnitro's fault): each names the outside cause it stands for
EXTERNAL: list[tuple[re.Pattern[str], str]] = [(re.compile(p), why) for p, why in (
    (r"mixed int8: with \d+/\d+ layers kept in fp32 the calibration cosine",
     "int8 cannot keep this model within the gate: a property of the model"),
    (r"OpenVINO could not convert the model: .*(No conversion rule|is not supported|[Uu]nsupported operation)",
     "OpenVINO's converter has no rule for an operation of this model"),
    (r"ONNX export failed: .*(Unsupported: ONNX export of|Exporting the operator .* is not supported)",
     "torch's ONNX exporter cannot express an operation of this model"),
)]


@dataclass(frozen=True)
class Verdict:
    kind: str  # 'ours', 'external', 'budget' or 'unexplained' (counted as ours)
    why: str

    @property
    def counts_against_us(self) -> bool:
        return self.kind in ("ours", "unexplained")


def classify(reason: str) -> Verdict:
    """The verdict on one failed candidate's reason (see the module docstring)."""
    reason = reason or ""
    mine = ours(reason)
    if mine:
        return Verdict("ours", f"matches our-fault pattern {mine[0]!r}")
    if reason.startswith("budget:") or reason.startswith("skipped (budget)"):
        return Verdict("budget", "the search budget ran out before it could run")
    for pattern, why in EXTERNAL:
        if pattern.search(reason):
            return Verdict("external", why)
    return Verdict("unexplained", "no known outside cause: counted as ours until explained")


def faults(candidates: Iterable[Any]) -> list[tuple[str, Verdict]]:
    """(recipe, verdict) for every failed candidate of a report that counts against us."""
    out = []
    for c in candidates:
        if c.status != "failed":
            continue
        v = classify(c.reason)
        if v.counts_against_us:
            out.append((c.recipe, v))
    return out
