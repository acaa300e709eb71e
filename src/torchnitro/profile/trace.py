"""Trace analysis on the Chrome/Perfetto trace ``torch.profiler`` writes (Holistic Trace Analysis' questions).

``analyze_trace(path)`` reads one trace (one rank) and answers, in microseconds:

- **temporal breakdown**, per rank and per stream (GPU) or thread (CPU): time running compute,
  communication (NCCL / c10d / gloo) and memory (memcpy / memset, copy ops) work, and idle time.
  On a GPU the window is first kernel start to last kernel end; where streams overlap, a moment
  counts once, as compute before communication before memory. On a CPU trace the window is the
  profiler's step ranges (or the whole trace without them) and the work is each thread's outermost
  ops (views and allocations are ``other``).
- **idle-time breakdown** (GPU): each gap between consecutive kernels on a stream is *host wait*
  when the next kernel's launch call returned after the previous kernel ended (the GPU waited for
  the CPU), *kernel wait* when the next kernel was already queued and the gap is at most
  ``TraceConfig.kernel_wait_us`` (launch latency between back-to-back kernels), else *other*
  (waiting on another stream, a synchronisation, ...).
- **duration distribution** of kernels (GPU) or outermost ops (CPU): per name count, total, mean,
  p50, p90, max, and a histogram over log2 buckets.
- **communication/computation overlap**: the share of communication time during which compute ran
  on any stream (GPU) or thread (CPU); ``None`` without communication.
- **launch statistics** (GPU): per kernel, its launch call (``cudaLaunchKernel`` & co., matched by
  correlation id) and the launch delay = kernel start - launch call end; short kernels are those
  shorter than their launch call, long delays those above ``TraceConfig.long_delay_us``.

The definitions follow HolisticTraceAnalysis (temporal / idle-time breakdown, kernel launch
statistics); this module is a small re-implementation on the plain JSON so that it runs on CPU
traces too and needs no pandas. See docs/profile.md.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from torchnitro.errors import ArtifactError, InputError
from torchnitro.profile.categories import category_of

__all__ = ["TraceConfig", "TraceAnalysis", "analyze_trace", "load_trace_events", "union_us", "intersection_us",
           "trace_lines"]

_KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_WORK = ("compute", "communication", "memory", "other")  # priority order where intervals overlap


@dataclass(frozen=True)
class TraceConfig:
    kernel_wait_us: float = 30.0  # a gap up to this long between queued kernels is launch latency, not waiting
    long_delay_us: float = 100.0  # launch delay above this is an outlier (the queue was deep, or the GPU busy)
    top: int = 10  # names listed in the duration distribution

    def __post_init__(self) -> None:
        if not (self.kernel_wait_us >= 0 and self.long_delay_us >= 0) or not isinstance(self.top, int) or self.top < 1:
            raise InputError(f"TraceConfig: received kernel_wait_us={self.kernel_wait_us}, long_delay_us="
                             f"{self.long_delay_us}, top={self.top}; expected times >= 0 and top >= 1")


@dataclass
class TraceAnalysis:
    """What ``analyze_trace`` found; every time is in microseconds over the whole trace window."""

    clock: str  # "device" (GPU kernels) or "cpu" (host ops only)
    rank: int
    span_us: float  # the window the breakdown covers
    temporal: list[dict[str, Any]] = field(default_factory=list)  # rows: rank, stream, compute...idle, span
    idle: list[dict[str, Any]] = field(default_factory=list)  # rows: stream, host_wait, kernel_wait, other
    durations: dict[str, Any] = field(default_factory=dict)  # by_name rows, histogram, overall percentiles
    overlap: dict[str, float] | None = None  # communication_us, overlapped_us, percent
    launch: dict[str, Any] | None = None  # launch-call statistics (GPU)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TraceAnalysis":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def total(self) -> dict[str, Any]:
        """The rank's row of the temporal breakdown (all streams or threads together)."""
        return next((r for r in self.temporal if r["stream"] == "all"), {})


# ---- interval arithmetic -----------------------------------------------------------------------

def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    return sum(b - a for a, b in _merge(intervals))


def intersection_us(x: Iterable[tuple[float, float]], y: Iterable[tuple[float, float]]) -> float:
    """Length of (union of x) intersected with (union of y)."""
    mx, my = _merge(x), _merge(y)
    i = j = 0
    total = 0.0
    while i < len(mx) and j < len(my):
        lo, hi = max(mx[i][0], my[j][0]), min(mx[i][1], my[j][1])
        total += max(0.0, hi - lo)
        if mx[i][1] < my[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: Iterable[tuple[float, float]], window: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals for lo, hi in window if b > lo and a < hi]


def _breakdown(work: Mapping[str, list[tuple[float, float]]], window: list[tuple[float, float]]) -> dict[str, float]:
    """Time of each kind of work inside ``window``, a moment counted once in ``_WORK`` order; the rest idle."""
    span = union_us(window)
    row: dict[str, float] = {}
    taken: list[tuple[float, float]] = []
    for kind in _WORK:
        mine = _clip(work.get(kind, []), window)
        row[kind] = union_us(mine) - intersection_us(mine, taken)
        taken = _merge(taken + mine)
    row["idle"] = max(0.0, span - union_us(taken))
    row["span"] = span
    return row


def _pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a non-empty list."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def _distribution(named: list[tuple[str, float]], top: int) -> dict[str, Any]:
    durs = [d for _, d in named]
    if not durs:
        return {}
    by: dict[str, list[float]] = defaultdict(list)
    for n, d in named:
        by[n].append(d)
    total = sum(durs)
    rows = [{"name": n, "count": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v), "p50_us": _pct(v, 0.5),
             "p90_us": _pct(v, 0.9), "max_us": max(v), "share": sum(v) / total if total > 0 else 0.0}
            for n, v in by.items()]
    rows.sort(key=lambda r: -r["total_us"])
    edges = [0.0] + [2.0 ** k for k in range(0, 21)]  # 0-1 us, 1-2 us, ... up to ~1 s
    counts = [0] * len(edges)
    for d in durs:
        counts[next((k - 1 for k in range(1, len(edges)) if d < edges[k]), len(edges) - 1)] += 1
    last = max(k for k, c in enumerate(counts) if c) + 1
    return {"count": len(durs), "total_us": total, "p50_us": _pct(durs, 0.5), "p90_us": _pct(durs, 0.9),
            "p99_us": _pct(durs, 0.99), "max_us": max(durs), "by_name": rows[:top], "names": len(rows),
            "histogram": {"edges_us": edges[:last + 1] if last < len(edges) else edges + [math.inf],
                          "counts": counts[:last]}}


# ---- reading the trace -------------------------------------------------------------------------

def load_trace_events(source: str | Path | Mapping[str, Any] | list[Any]) -> dict[str, Any]:
    """The trace as a dict with ``traceEvents``; one clear error for a missing, empty or foreign file."""
    if isinstance(source, (Mapping, list)):
        data: Any = source
        where = "the trace"
    else:
        p = Path(source)
        where = str(p)
        if not p.is_file():
            raise InputError(f"{p}: no such trace file; expected a Chrome trace written by torch.profiler "
                             "(export_chrome_trace, or trace.json beside a saved profile)")
        text = p.read_text()
        if not text.strip():
            raise ArtifactError(f"{p}: the trace file is empty; expected a Chrome trace JSON (re-export it)")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno}); the trace is truncated "
                                "or not a Chrome trace") from exc
    if isinstance(data, list):  # the JSON array form of the trace format
        data = {"traceEvents": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("traceEvents"), list):
        got = sorted(data)[:6] if isinstance(data, Mapping) else type(data).__name__
        raise InputError(f"{where}: received {got}; expected a Chrome trace object with a 'traceEvents' list")
    return dict(data)


def _spans(events: list[Any], cats: set[str]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in cats
            and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]


def _kind(e: Mapping[str, Any]) -> str:
    if e.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    return {"communication": "communication", "copy": "memory"}.get(category_of(str(e.get("name", ""))), "compute")


def _outermost(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ops not nested in another op of the same thread (nested ones are part of their parent's time)."""
    out: list[dict[str, Any]] = []
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        end = -math.inf
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def analyze_trace(source: str | Path | Mapping[str, Any] | list[Any], config: TraceConfig | None = None) -> TraceAnalysis:
    """Analyse one rank's trace (a path or the loaded JSON); see the module doc for each number."""
    cfg = config or TraceConfig()
    data = load_trace_events(source)
    events = data["traceEvents"]
    rank = int((data.get("distributedInfo") or {}).get("rank", 0) or 0)
    kernels = _spans(events, _KERNEL_CATS)
    if kernels:
        return _device(kernels, _spans(events, _LAUNCH_CATS), rank, cfg)
    return _host(_spans(events, {"cpu_op"}), _spans(events, {"user_annotation"}), rank, cfg)


def _device(kernels: list[dict[str, Any]], launches: list[dict[str, Any]], rank: int,
            cfg: TraceConfig) -> TraceAnalysis:
    window = [(min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels))]
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for k in kernels:
        args = k.get("args") or {}
        streams[f"{args.get('device', k.get('pid'))}:{args.get('stream', k.get('tid'))}"].append(k)
    work = _work(kernels)
    temporal = [{"rank": rank, "stream": "all", **_breakdown(work, window)}]
    launch_of = {(e.get("args") or {}).get("correlation"): e for e in launches}
    launch_of.pop(None, None)
    idle_rows = []
    for name, ks in sorted(streams.items()):
        ks.sort(key=lambda k: k["ts"])
        sw = [(ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks))]
        temporal.append({"rank": rank, "stream": name, **_breakdown(_work(ks), sw)})
        idle_rows.append({"stream": name, **_idle(ks, launch_of, cfg)})
    total_idle = {k: sum(r[k] for r in idle_rows) for k in ("host_wait_us", "kernel_wait_us", "other_us", "idle_us")}
    idle_rows.insert(0, {"stream": "all", **total_idle})
    named = [(str(k.get("name", "")), float(k["dur"])) for k in kernels]
    return TraceAnalysis("device", rank, window[0][1] - window[0][0], temporal, idle_rows,
                         _distribution(named, cfg.top), _overlap(work), _launch(kernels, launch_of, cfg),
                         [f"{len(kernels)} kernels on {len(streams)} stream(s)"])


def _work(spans: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    work: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        work[e.get("_kind") or _kind(e)].append((float(e["ts"]), float(e["ts"] + e["dur"])))
    return work


def _idle(ks: list[dict[str, Any]], launch_of: Mapping[Any, dict[str, Any]], cfg: TraceConfig) -> dict[str, float]:
    """Split a stream's gaps between consecutive kernels into host wait / kernel wait / other."""
    row = {"host_wait_us": 0.0, "kernel_wait_us": 0.0, "other_us": 0.0}
    end = ks[0]["ts"] + ks[0]["dur"]
    for k in ks[1:]:
        gap = k["ts"] - end
        if gap > 0:
            rt = launch_of.get((k.get("args") or {}).get("correlation"))
            if rt is not None and rt["ts"] + rt["dur"] >= end:
                row["host_wait_us"] += gap
            elif rt is not None and gap <= cfg.kernel_wait_us:
                row["kernel_wait_us"] += gap
            else:
                row["other_us"] += gap
        end = max(end, k["ts"] + k["dur"])
    row["idle_us"] = sum(row.values())
    return row


def _overlap(work: Mapping[str, list[tuple[float, float]]]) -> dict[str, float] | None:
    comm = work.get("communication", [])
    if not comm:
        return None
    total, both = union_us(comm), intersection_us(comm, work.get("compute", []))
    return {"communication_us": total, "overlapped_us": both, "percent": 100.0 * both / total if total > 0 else 0.0}


def _launch(kernels: list[dict[str, Any]], launch_of: Mapping[Any, dict[str, Any]],
            cfg: TraceConfig) -> dict[str, Any] | None:
    pairs = [(k, launch_of[c]) for k in kernels if (c := (k.get("args") or {}).get("correlation")) in launch_of]
    if not pairs:
        return None
    delays = [k["ts"] - (rt["ts"] + rt["dur"]) for k, rt in pairs]
    calls = [float(rt["dur"]) for _, rt in pairs]
    short = sum(1 for k, rt in pairs if k["dur"] < rt["dur"])
    return {"kernels": len(pairs), "unmatched": len(kernels) - len(pairs),
            "launch_call_p50_us": _pct(calls, 0.5), "launch_call_p90_us": _pct(calls, 0.9),
            "delay_p50_us": _pct(delays, 0.5), "delay_p90_us": _pct(delays, 0.9), "delay_max_us": max(delays),
            "short_kernels": short, "short_share": short / len(pairs),
            "long_delays": sum(1 for d in delays if d > cfg.long_delay_us), "long_delay_cutoff_us": cfg.long_delay_us}


def _host(ops: list[dict[str, Any]], annotations: list[dict[str, Any]], rank: int, cfg: TraceConfig) -> TraceAnalysis:
    if not ops:
        return TraceAnalysis("cpu", rank, 0.0, notes=["the trace holds no ops (cpu_op events) and no kernels"])
    steps = [(float(e["ts"]), float(e["ts"] + e["dur"])) for e in annotations
             if str(e.get("name", "")).startswith("ProfilerStep")]
    window = _merge(steps) or [(min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops))]
    top = _outermost(ops)
    for e in top:  # views and allocations are neither compute nor idle
        cat = category_of(str(e.get("name", "")))
        e["_kind"] = {"communication": "communication", "copy": "memory", "cpu_overhead": "other"}.get(cat, "compute")
    threads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in top:
        threads[f"{e.get('pid')}:{e.get('tid')}"].append(e)
    work = _work(top)
    temporal = [{"rank": rank, "stream": "all", **_breakdown(work, window)}]
    temporal += [{"rank": rank, "stream": t, **_breakdown(_work(evs), window)} for t, evs in sorted(threads.items())]
    inside = _clip([(e["ts"], e["ts"] + e["dur"]) for e in top], window)
    named = [(str(e.get("name", "")), float(e["dur"])) for e in top
             if any(lo <= e["ts"] < hi for lo, hi in window)]
    for e in top:
        e.pop("_kind", None)
    notes = [f"{len(named)} outermost ops on {len(threads)} thread(s)"
             + (f" over {len(steps)} profiler step(s)" if steps else " (no ProfilerStep ranges: the whole trace)"),
             "CPU trace: no idle-time breakdown or launch statistics (those need GPU kernels)"]
    return TraceAnalysis("cpu", rank, union_us(window), temporal, [], _distribution(named, cfg.top),
                         _overlap(work), None, notes + ([] if inside else ["no op falls inside the step ranges"]))


def trace_lines(t: TraceAnalysis | Mapping[str, Any]) -> list[str]:
    """The analysis as summary lines (``Profile.summary`` and ``torchnitro profile --trace`` print them)."""
    a = TraceAnalysis.from_dict(t) if isinstance(t, Mapping) else t
    unit = "stream" if a.clock == "device" else "thread"
    lines = [f"trace analysis (rank {a.rank}, {a.clock} clock, window {a.span_us / 1e3:.3f} ms):",
             f"  {'':<14}{'compute':>9}{'comm':>8}{'memory':>8}{'other':>8}{'idle':>8}  (% of {unit} window)"]
    for r in a.temporal:
        s = r["span"] or 1.0
        lines.append(f"  {str(r['stream'])[:14]:<14}" + "".join(f"{100 * r[k] / s:{w}.1f}" for k, w in
                                                                 zip(_WORK + ("idle",), (9, 8, 8, 8, 8))))
    for r in a.idle[:1]:
        if r["idle_us"] > 0:
            lines.append(f"  device idle {r['idle_us'] / 1e3:.3f} ms: host wait {r['host_wait_us'] / r['idle_us']:.0%}, "
                         f"kernel wait {r['kernel_wait_us'] / r['idle_us']:.0%}, other {r['other_us'] / r['idle_us']:.0%}")
    if a.overlap:
        lines.append(f"  communication {a.overlap['communication_us'] / 1e3:.3f} ms, {a.overlap['percent']:.0f}% of it "
                     "overlapped with compute")
    if a.launch:
        ln = a.launch
        lines.append(f"  launches: {ln['kernels']} kernels, delay p50 {ln['delay_p50_us']:.1f} us p90 "
                     f"{ln['delay_p90_us']:.1f} us, {ln['short_share']:.0%} shorter than their launch call, "
                     f"{ln['long_delays']} delays > {ln['long_delay_cutoff_us']:g} us")
    d = a.durations
    if d:
        what = "kernel" if a.clock == "device" else "op"
        lines.append(f"  {d['count']} {what}s: p50 {d['p50_us']:.1f} us, p90 {d['p90_us']:.1f} us, max "
                     f"{d['max_us']:.1f} us; longest in total:")
        for r in d["by_name"][:5]:
            lines.append(f"    {r['share']:6.1%} x{r['count']:<5} mean {r['mean_us']:9.1f} us  {r['name'][:70]}")
    return lines + [f"  note: {n}" for n in a.notes]
