"""``Profile``: what one profiled step costs, by category and by op; JSON round trip and ``summary()``.

Times are seconds per step (the mean over the recorded steps). ``clock`` says which clock the
categories measure: ``"cpu"`` (no GPU work was recorded: op time on the host, the rest is
``unattributed``) or ``"device"`` (kernel time on the GPU attributed to the op that launched it, the
rest is ``device_idle``). Either way the categories add up to ``step_time_s``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torchnitro.errors import ArtifactError, InputError
from torchnitro.profile.categories import CATEGORIES

__all__ = ["Profile", "OpStat", "FORMAT_VERSION", "findings"]

FORMAT_VERSION = 1  # profile.json layout; a reader refuses a newer one


@dataclass
class OpStat:
    """One op (name + input shapes) of the step: its own time, without the ops it calls."""

    name: str
    category: str
    shapes: str  # input shapes as the profiler recorded them, "" when not recorded
    calls: float  # per step
    time_s: float  # self time per step
    share: float  # of the step time


@dataclass
class Profile:
    """The result of ``torchnitro.profile``; ``save(dir)`` writes the trace, JSON, plots and report."""

    device: str  # "cpu" or a GPU name
    clock: str  # "cpu" or "device": which time the categories split (module doc)
    warmup: int
    steps: int
    step_time_s: float  # mean wall time of one recorded step (profiler's step ranges)
    step_times_s: list[float]
    categories: dict[str, float]  # category -> seconds per step; sums to step_time_s
    top_ops: list[OpStat] = field(default_factory=list)
    flops: int | None = None  # per step (FlopCounterMode on one extra step); None when not counted
    flops_by_category: dict[str, int] = field(default_factory=dict)
    peak_flops: float | None = None  # FLOP/s MFU is taken against; None: no peak known here
    peak_source: str = "none"  # where peak_flops came from
    peak: dict[str, Any] = field(default_factory=dict)  # profile.peak.GemmPeak.to_dict(): timings, best, median
    unprofiled_step_times_s: list[float] = field(default_factory=list)  # plain steps right after the profiler
    memory: dict[str, Any] = field(default_factory=dict)  # peak_bytes, by_category, source
    monitor: dict[str, Any] = field(default_factory=dict)  # energy / power / utilisation samplers
    environment: dict[str, str] = field(default_factory=dict)  # machine, versions, threads
    findings: list[str] = field(default_factory=list)
    trace_analysis: dict[str, Any] = field(default_factory=dict)  # profile.trace.TraceAnalysis.to_dict(); {} if none
    trace_path: str | None = field(default=None, compare=False)  # exported Chrome trace (temp file until saved)
    version: int = FORMAT_VERSION

    # ---- derived numbers -----------------------------------------------------------------------
    @property
    def shares(self) -> dict[str, float]:
        """Category -> fraction of the step time."""
        t = self.step_time_s
        return {k: (v / t if t > 0 else 0.0) for k, v in self.categories.items()}

    @property
    def achieved_flops(self) -> float | None:
        """FLOP/s over the whole step."""
        return self.flops / self.step_time_s if self.flops is not None and self.step_time_s > 0 else None

    @property
    def mfu(self) -> float | None:
        """Model FLOP utilisation: achieved FLOP/s over the peak (None without a known peak)."""
        a = self.achieved_flops
        return a / self.peak_flops if a is not None and self.peak_flops else None

    @property
    def mfu_range(self) -> tuple[float, float] | None:
        """MFU against the best and against the median peak timing: the range the peak's own noise allows."""
        a, best, med = self.achieved_flops, self.peak.get("best"), self.peak.get("median")
        return (a / best, a / med) if a is not None and best and med else None

    @property
    def unprofiled_step_time_s(self) -> float | None:
        """Mean of the plain steps timed right after the profiler (None when none were run)."""
        t = self.unprofiled_step_times_s
        return sum(t) / len(t) if t else None

    @property
    def profiled_over_unprofiled(self) -> float | None:
        """Median profiled step over median plain step: the profiler's cost on this step (1.0: none)."""
        import statistics

        t, u = self.step_times_s, self.unprofiled_step_times_s
        return statistics.median(t) / statistics.median(u) if t and u and statistics.median(u) > 0 else None

    @property
    def accounted(self) -> float:
        """Sum of the categories over the profiled step (1.0: every microsecond is in some category)."""
        return sum(self.categories.values()) / self.step_time_s if self.step_time_s > 0 else 0.0

    def achieved_flops_by_category(self) -> dict[str, float]:
        """FLOP/s inside each category's own time (how well its kernels run)."""
        return {c: f / self.categories[c] for c, f in self.flops_by_category.items()
                if f and self.categories.get(c, 0) > 0}

    # ---- text ----------------------------------------------------------------------------------
    def summary(self) -> str:
        """A plain-text report: time by category, top ops, FLOPs / MFU, memory, energy, findings."""
        ms = 1e3
        lines = [f"step profile on {self.device} ({self.clock} clock): {self.steps} steps after {self.warmup} "
                 f"warm-up, {self.step_time_s * ms:.3f} ms per step"]
        if self.unprofiled_step_time_s is not None:
            lines.append(f"unprofiled: {self.unprofiled_step_time_s * ms:.3f} ms per step (mean of "
                         f"{len(self.unprofiled_step_times_s)} plain steps right after); profiled / unprofiled "
                         f"{self.profiled_over_unprofiled:.3f} (medians)")
        lines += ["", f"time by category (they add up to {self.accounted:.1%} of the profiled step):"]
        rate = self.achieved_flops_by_category()
        for c in CATEGORIES:
            if c in self.categories:
                extra = f"  {rate[c] / 1e9:9.2f} GFLOP/s" if c in rate else ""
                extra += f" ({rate[c] / self.peak_flops:.0%} of peak)" if c in rate and self.peak_flops else ""
                lines.append(f"  {c:<14}{self.categories[c] * ms:10.3f} ms {self.shares[c]:7.1%}{extra}")
        lines += ["", f"top ops (self time, of {len(self.top_ops)} listed):"]
        for op in self.top_ops:
            lines.append(f"  {op.share:6.1%} {op.time_s * ms:9.3f} ms  x{op.calls:<5g} {op.name} [{op.category}]"
                         + (f" {op.shapes}" if op.shapes else ""))
        lines.append("")
        if self.flops is None:
            lines.append("FLOPs: not counted")
        else:
            lines.append(f"FLOPs per step: {self.flops / 1e9:.4f} GFLOP, achieved {(self.achieved_flops or 0) / 1e9:.2f} "
                         "GFLOP/s")
            if self.mfu is not None and self.peak_flops:
                rng = self.mfu_range
                extra = f", {rng[1]:.1%} against the median timing" if rng else ""
                lines.append(f"MFU: {self.mfu:.1%} of {self.peak_flops / 1e9:.1f} GFLOP/s{extra} ({self.peak_source})")
            else:
                lines.append(f"MFU: unavailable ({self.peak_source})")
        if self.memory:
            lines.append(f"memory: peak {self.memory.get('peak_bytes', 0) / 2**20:.2f} MiB ({self.memory.get('source')})")
            for k, v in self.memory.get("by_category", {}).items():
                if v:
                    lines.append(f"  {k:<16}{v / 2**20:10.2f} MiB")
        for name, m in self.monitor.items():
            lines.append(f"{name}: {m.get('summary', m.get('unavailable', ''))}")
        if self.trace_analysis:
            from torchnitro.profile.trace import trace_lines

            lines += [""] + trace_lines(self.trace_analysis)
        lines += ["", "findings:"] + [f"  - {f}" for f in (self.findings or ["none"])]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # ---- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("trace_path")
        d.update(achieved_flops=self.achieved_flops, mfu=self.mfu, shares=self.shares)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        if not isinstance(data, dict) or "categories" not in data:
            raise InputError(f"a profile: received {type(data).__name__} without 'categories'; expected the "
                             "contents of a profile.json written by Profile.save")
        if int(data.get("version", 0)) > FORMAT_VERSION:
            raise ArtifactError(f"profile.json has format version {data['version']}; this torchnitro reads up to "
                                f"{FORMAT_VERSION}. Upgrade torchnitro to read it.")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["top_ops"] = [OpStat(**o) for o in data.get("top_ops", [])]
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a ``profile.json`` (or the directory ``save`` wrote)."""
        p = Path(path)
        p = p / "profile.json" if p.is_dir() else p
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError as exc:
            raise InputError(f"{p}: no such file; expected a profile.json written by Profile.save") from exc
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{p}: not valid JSON ({exc}); the file is truncated or not a profile") from exc
        return cls.from_dict(data)

    def save(self, directory: str | Path) -> Path:
        """Write trace.json, profile.json, the PNG plots and report.html into ``directory``."""
        from torchnitro.profile.report import write_report

        return write_report(self, Path(directory))


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return str(v)


def findings(p: Profile) -> list[str]:
    """Where the time goes, turned into what to try (thresholds are first guesses, not calibrated)."""
    s = p.shares
    out = []
    if s.get("device_idle", 0) > 0.3:
        out.append(f"device idle {s['device_idle']:.0%} of the step between kernels: launch-bound; try the "
                   "cuda-graphs or compile-reduce-overhead recipe, or a larger batch")
    host = s.get("cpu_overhead", 0) + s.get("unattributed", 0)
    if host > 0.3 and p.clock == "cpu":
        out.append(f"{host:.0%} of the step is outside any compute op ({s.get('unattributed', 0):.0%} between ops: "
                   f"Python, dispatch, waiting; {s.get('cpu_overhead', 0):.0%} views/allocations): ops are small; "
                   "try the compile recipe or a larger batch")
    ratio = p.profiled_over_unprofiled
    if ratio is not None and ratio > 1.10:
        out.append(f"the profiled step is {ratio:.2f}x the unprofiled one: the profiler's per-op cost matters for "
                   "this step (many small ops); trust the shares more than the absolute times")
    if s.get("norm", 0) > 0.15:
        out.append(f"normalisation takes {s['norm']:.0%}: try the fused-kernels recipe (fused RMSNorm / LayerNorm)")
    if s.get("pointwise", 0) > 0.3:
        out.append(f"elementwise ops take {s['pointwise']:.0%}: a compiler fuses chains of them (compile recipe)")
    if s.get("copy", 0) > 0.15:
        out.append(f"copies and transfers take {s['copy']:.0%}: look for .to()/.contiguous() in the step and "
                   "host-device transfers (pin_memory, non_blocking)")
    if s.get("communication", 0) > 0.2:
        out.append(f"communication takes {s['communication']:.0%}: overlap it with compute (bucketed DDP, FSDP "
                   "prefetch) or reduce it (gradient accumulation)")
    out += _trace_findings(p.trace_analysis)
    if p.mfu is not None and s.get("matmul", 0) > 0.5 and p.mfu < 0.3:
        out.append(f"matmul dominates ({s['matmul']:.0%}) but MFU is {p.mfu:.0%}: the GEMMs are small or "
                   "misaligned; pad dims to multiples of 64 or batch more work per step")
    return out


def _trace_findings(t: dict[str, Any]) -> list[str]:
    """Rules on the trace analysis (GPU idle causes, short kernels, unoverlapped communication)."""
    out = []
    idle = (t.get("idle") or [{}])[0]
    span = t.get("span_us") or 0.0
    if span > 0 and idle.get("host_wait_us", 0) > 0.2 * span:
        out.append(f"the GPU waited on the CPU for {idle['host_wait_us'] / span:.0%} of the kernel window (host "
                   "wait): launch-bound; try the cuda-graphs or compile-reduce-overhead recipe")
    launch = t.get("launch") or {}
    if launch.get("kernels", 0) >= 20 and launch.get("short_share", 0) > 0.5:
        out.append(f"{launch['short_share']:.0%} of kernels run shorter than their launch call: fuse them (compile "
                   "recipe) or replay them as a CUDA graph")
    ov = t.get("overlap") or {}
    if span > 0 and ov.get("communication_us", 0) > 0.1 * span and ov.get("percent", 100) < 50:
        out.append(f"only {ov['percent']:.0f}% of communication overlaps compute: bucket gradients (DDP) or "
                   "prefetch (FSDP) so collectives run under compute")
    return out
