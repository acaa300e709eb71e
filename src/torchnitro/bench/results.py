"""Benchmark result files with raw samples: what ``bench compare`` and ``bench history`` read.

A result file keeps every sample, not just the median, so two runs can be compared with a test on
the samples. Layout (JSON)::

    {"format": "torchnitro-bench", "version": 1,
     "environment": {"machine": ..., "versions": ..., "torch threads": ..., "commit": ..., ...},
     "cases": {"attention/small": {"samples_s": [...], "calls_per_sample": 8}, ...}}

``environment`` is ``provenance()`` plus ``timing_environment()``: two files whose machine or
thread settings differ are not comparable (``check_comparable``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from torchnitro.bench.timing import Timing
from torchnitro.errors import ArtifactError, InputError

__all__ = ["BenchResult", "write_results", "read_results", "check_comparable", "FORMAT", "VERSION", "MIN_SAMPLES",
           "COMPARABLE_KEYS"]

FORMAT, VERSION = "torchnitro-bench", 1
MIN_SAMPLES = 5  # fewer samples cannot support a rank test at any useful level
COMPARABLE_KEYS = ("machine", "torch threads", "torch_threads")  # must match for two files to be compared


@dataclass
class BenchResult:
    """One run: case name -> seconds per call, one entry per sample; and where it ran."""

    cases: dict[str, list[float]]
    environment: dict[str, str] = field(default_factory=dict)
    path: str = ""  # the file it was read from (for messages)


def write_results(path: str | Path, cases: Mapping[str, Timing | Sequence[float]],
                  environment: Mapping[str, str] | None = None, *, script: str = "torchnitro bench",
                  skipped: Mapping[str, str] | None = None) -> Path:
    """Write a result file; ``environment`` defaults to this process's provenance and timing settings.

    ``skipped`` (case or tier -> why) is kept in the file for a reader; comparisons ignore it.
    """
    if environment is None:
        from torchnitro.bench.environment import timing_environment
        from torchnitro.bench.provenance import provenance

        environment = {**provenance(script), **timing_environment()}
    out: dict[str, dict[str, object]] = {}
    for name, c in cases.items():
        if isinstance(c, Timing):
            out[name] = {"samples_s": list(c.samples), "calls_per_sample": c.calls_per_sample}
        else:
            out[name] = {"samples_s": [float(x) for x in c], "calls_per_sample": 1}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"format": FORMAT, "version": VERSION, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "environment": dict(environment), "cases": out, "skipped": dict(skipped or {})},
                            indent=1))
    return p


def read_results(path: str | Path) -> BenchResult:
    """Read and check a result file: one clear error for a missing, empty, truncated or foreign file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such result file; expected a JSON file written by torchnitro bench")
    text = p.read_text()
    if not text.strip():
        raise ArtifactError(f"{p}: the file is empty; expected a torchnitro bench result (rerun the benchmark)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno}); the file is truncated or "
                            "corrupted, rerun the benchmark") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        hint = " (a ResultTable with medians only: raw samples are needed)" if isinstance(data, dict) and "rows" in data else ""
        raise InputError(f"{p}: format {got!r}{hint}; expected a {FORMAT!r} result file with raw samples")
    if int(data.get("version", 0)) > VERSION:
        raise ArtifactError(f"{p}: result format version {data['version']}; this torchnitro reads up to {VERSION}")
    cases: dict[str, list[float]] = {}
    for name, c in (data.get("cases") or {}).items():
        s = c.get("samples_s") if isinstance(c, dict) else None
        if not isinstance(s, list) or len(s) < MIN_SAMPLES or not all(isinstance(x, (int, float)) and x > 0 for x in s):
            n = len(s) if isinstance(s, list) else 0
            raise ArtifactError(f"{p}: case {name!r} has {n} usable samples; expected at least {MIN_SAMPLES} positive "
                                "seconds-per-call values in 'samples_s'")
        cases[name] = [float(x) for x in s]
    if not cases:
        raise ArtifactError(f"{p}: no cases; expected at least one case with samples")
    return BenchResult(cases, {str(k): str(v) for k, v in (data.get("environment") or {}).items()}, str(p))


def check_comparable(base: BenchResult, new: BenchResult) -> list[str]:
    """Raise ``InputError`` when the two runs come from different machines or thread settings.

    Returns the other environment differences (versions, commit, allocator...), which are what a
    comparison is usually about, as notes for the report.
    """
    diff = {k for k in set(base.environment) | set(new.environment)
            if base.environment.get(k) != new.environment.get(k)}
    hard = [k for k in COMPARABLE_KEYS if k in diff]
    if hard:
        parts = "; ".join(f"{k}: {base.environment.get(k)!r} vs {new.environment.get(k)!r}" for k in hard)
        raise InputError(f"{base.path} and {new.path} are not comparable ({parts}); expected both runs on the same "
                         "machine with the same thread settings. Rerun both here, or pass --force to compare anyway")
    return [f"{k}: {base.environment.get(k)} -> {new.environment.get(k)}" for k in sorted(diff)
            if k not in ("started", "written", "load average at start", "command")]
