"""The search report: one row per candidate, printable as a rich table, JSON and Markdown."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Status", "CandidateResult", "Report", "BUSY_NOTE"]


# how a row's notes begin the remark that its search-time timing ran on a busy machine (autotune.evaluate)
BUSY_NOTE = "timed on a busy machine"


class Status:
    CHOSEN = "chosen"  # the variant optimize() returns
    VERIFIED = "verified"  # passed the gate, not the fastest
    REJECTED = "rejected"  # built and ran, failed the gate: never chosen
    SKIPPED = "skipped"  # not applicable here, not selected, or the budget ran out
    FAILED = "failed"  # raised, hung past its limit, or crashed its process


@dataclass
class CandidateResult:
    recipe: str
    numeric_class: str
    status: str
    reason: str = ""  # why skipped/failed/rejected, or notes for verified ones
    build_s: float | None = None  # seconds to build (0 when loaded from the cache)
    p50_ms: float | None = None
    p99_ms: float | None = None
    cv: float | None = None  # coefficient of variation of the samples
    throughput: float | None = None  # items (batch rows) per second at p50
    speedup: float | None = None  # eager p50 / this p50 (>1 is faster), from the interleaved comparison when a finalist
    noise: float | None = None  # how far the speedup's 95% interval reaches below it (bench.ratio), interleaved only
    peak_mem_mb: float | None = None  # GPU: peak allocated; CPU: peak resident-set growth (5 ms sampling)
    max_abs: float | None = None
    max_rel: float | None = None
    norm_rel: float | None = None
    min_cosine: float | None = None
    metric: float | None = None
    shape_ms: dict[str, float] = field(default_factory=dict)  # 'BxT' -> p50 ms at each dynamic size
    first_call_ms: dict[str, float] = field(default_factory=dict)  # first call at each new size (recompilation)
    interleaved: bool = False  # p50/p99/speedup come from an interleaved run (else: search timing): the final
    # comparison, or the screen's short run for a candidate screened out (``screened``)
    screened: bool = False  # screened out before the final comparison: its numbers are the screen's estimate (~)
    isolated: bool = False
    alone: bool = False  # the comparison timed it alone in its own process (own runtime), alternating with eager
    redone: bool = False  # the final comparison was redone: eager inside it differed from eager alone
    cached: bool = False
    notes: str = ""
    process_p50_ms: list[float] = field(default_factory=list)  # eager: p50 of each final-comparison process (p50_ms: median)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.{digits}f}"
    return str(v)


_WHY_WIDTH = 48  # longer reasons are listed in full under the table

_COLUMNS = ("recipe", "class", "status", "p50 ms", "p99 ms", "items/s", "speedup", "mem MB", "rel err",
            "min cos", "build s", "why")


@dataclass
class Report:
    model: str  # what was optimised (builtin name, factory, class name)
    inputs: str  # input signature, e.g. 'int64[8x128]'
    objective: str  # e.g. 'latency p50 at batch 8'
    hardware: str
    candidates: list[CandidateResult] = field(default_factory=list)
    chosen: str = "eager"
    search_s: float = 0.0
    cached: bool = False  # the whole search came from the cache
    notes: list[str] = field(default_factory=list)

    def get(self, recipe: str) -> CandidateResult:
        for c in self.candidates:
            if c.recipe == recipe:
                return c
        raise KeyError(f"no candidate {recipe!r} in this report; candidates: {[c.recipe for c in self.candidates]}")

    def rows(self) -> list[list[str]]:
        out = []
        for c in self.candidates:
            out.append([
                c.recipe, c.numeric_class, c.status, _fmt(c.p50_ms), _fmt(c.p99_ms), _fmt(c.throughput, 1),
                ("~" if c.speedup is not None and (c.screened or not c.interleaved) else "") + _fmt(c.speedup)
                + ("x" if c.speedup is not None else "") + (f" ±{c.noise:.2f}" if c.noise is not None else ""),
                _fmt(c.peak_mem_mb, 1),
                _fmt(c.norm_rel), _fmt(c.min_cosine, 5), _fmt(c.build_s, 1) + (" (cache)" if c.cached else ""),
                c.reason or c.notes,
            ])
        return out

    def _footnotes(self) -> list[str]:
        notes: list[str] = []
        for c in self.candidates:
            if c.reason and len(c.reason) > _WHY_WIDTH:
                notes.append(f"{c.recipe}: {c.reason}")
        return notes

    def _header(self) -> list[str]:
        return [f"model: {self.model}", f"inputs: {self.inputs}", f"objective: {self.objective}",
                f"hardware: {self.hardware}", f"chosen: {self.chosen}",
                f"search: {self.search_s:.1f} s" + (" (from cache)" if self.cached else ""), *self.notes,
                *self._screened_legend(), *self._busy_legend()]

    def _screened_legend(self) -> list[str]:
        """The legend of the ``~`` on rows screened out (the general ``~`` note speaks of search-time estimates)."""
        names = [c.recipe for c in self.candidates if c.screened and c.speedup is not None]
        if not names:
            return []
        return [f"~ on {', '.join(names)}: screened out before the final comparison; the speedup is the screen's "
                "(a short interleaved run with eager, ± its noise), not comparable with the final comparison's"]

    def _busy_legend(self) -> list[str]:
        """Which search-time estimates (``~`` against eager's search-time p50) a busy machine made meaningless."""
        busy = {c.recipe for c in self.candidates if BUSY_NOTE in c.notes}
        estimates = [c.recipe for c in self.candidates if c.speedup is not None and not c.interleaved]
        if "eager" in busy and estimates:
            return ["search-time estimates (~) unreliable: eager's search-time p50, the baseline of every one, was "
                    f"{BUSY_NOTE} (its threads waited for a CPU; its row's note gives the share); the unmarked "
                    "speedups come from the comparison's gated samples"]
        names = [n for n in estimates if n in busy]
        if not names:
            return []
        return [f"search-time estimates (~) of {', '.join(names)} unreliable: {BUSY_NOTE} (their threads waited "
                "for a CPU; each row's note gives the share); the unmarked speedups come from the comparison's gated "
                "samples"]

    def to_markdown(self) -> str:
        lines = ["## torchnitro optimize report", ""] + [f"- {h}" for h in self._header()] + [""]
        lines.append("| " + " | ".join(_COLUMNS) + " |")
        lines.append("| " + " | ".join("---" for _ in _COLUMNS) + " |")
        for r in self.rows():
            lines.append("| " + " | ".join(x.replace("|", "/").replace("\n", " ") for x in r) + " |")
        return "\n".join(lines + [""] + [f"- {n}" for n in self._footnotes()]) + "\n"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [c.to_dict() for c in self.candidates]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        d = dict(d)
        d["candidates"] = [CandidateResult(**c) for c in d.get("candidates", [])]
        return cls(**d)

    def rich(self):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title="torchnitro optimize", caption="\n".join(self._header() + self._footnotes()),
                  caption_justify="left")
        for c in _COLUMNS:
            if c == "why":
                t.add_column(c, overflow="ellipsis", no_wrap=True, max_width=_WHY_WIDTH, ratio=1)
            else:
                t.add_column(c, no_wrap=True, min_width=max(len(c), 8))
        styles = {Status.CHOSEN: "bold green", Status.REJECTED: "red", Status.FAILED: "red", Status.SKIPPED: "dim"}
        for c, r in zip(self.candidates, self.rows()):
            t.add_row(*r, style=styles.get(c.status))
        return t

    def __str__(self) -> str:
        from io import StringIO

        from rich.console import Console

        buf = StringIO()
        Console(file=buf, width=200, force_terminal=False).print(self.rich())
        return buf.getvalue()

    __repr__ = __str__
