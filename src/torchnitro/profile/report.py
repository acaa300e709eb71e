"""``Profile.save(dir)``: trace.json, profile.json, PNG plots and a self-contained report.html.

The HTML has no external assets: CSS is inline and the plots are embedded as base64 PNG, so the
file can be mailed or attached to a CI run and opened anywhere. The trace opens in Perfetto
(ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import base64
import html
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchnitro.profile.categories import CATEGORIES, DESCRIPTIONS

if TYPE_CHECKING:
    from torchnitro.profile.result import Profile

__all__ = ["write_report", "render_html", "plot_categories", "plot_top_ops", "plot_durations", "trace_html",
           "SECTIONS"]

# ids of the report's sections, in order (a test checks each is present)
SECTIONS = ("overview", "categories", "top-ops", "flops", "memory", "monitoring", "trace-analysis", "findings",
            "environment")

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}td,th{border:1px solid #ddd;padding:.3em .6em;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #eee}.muted{color:#777}li{margin:.3em 0}code{background:#f4f4f4;padding:0 .2em}
"""
_COLORS = {"matmul": "#4c72b0", "attention": "#8172b3", "norm": "#dd8452", "pointwise": "#55a868",
           "copy": "#c44e52", "communication": "#937860", "other": "#8c8c8c", "cpu_overhead": "#da8bc3",
           "unattributed": "#e5c494", "device_idle": "#cccccc"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_categories(p: "Profile", path: Path) -> Path:
    """Horizontal bar chart: milliseconds per step by category."""
    plt = _plt()
    cats = [c for c in CATEGORIES if c in p.categories]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(cats) + 1.2))
    vals = [p.categories[c] * 1e3 for c in cats]
    ax.barh(cats[::-1], vals[::-1], color=[_COLORS.get(c, "#888") for c in cats[::-1]])
    for y, (c, v) in enumerate(zip(cats[::-1], vals[::-1])):
        ax.text(v, y, f" {v:.3f} ms ({p.shares[c]:.0%})", va="center", fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_title(f"time by category ({p.clock} clock, {p.step_time_s * 1e3:.3f} ms per step)")
    ax.set_xlim(0, max(vals + [1e-9]) * 1.35)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_top_ops(p: "Profile", path: Path, n: int = 12) -> Path:
    """Horizontal bar chart: share of the step of the top ops (self time)."""
    plt = _plt()
    ops = p.top_ops[:n]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(len(ops), 1) + 1.2))
    labels = [f"{o.name.rsplit(': ', 1)[-1].removeprefix('aten::')[:40]} {o.shapes[:30]}" for o in ops][::-1]
    ax.barh(labels or ["(none)"], [o.share * 100 for o in ops][::-1] or [0],
            color=[_COLORS.get(o.category, "#888") for o in ops][::-1] or None)
    ax.set_xlabel("% of step time (self)")
    ax.set_title("top ops")
    ax.tick_params(axis="y", labelsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_durations(t: dict[str, Any], path: Path) -> Path | None:
    """Histogram of kernel (GPU) or outermost-op (CPU) durations over log2 buckets; None without any."""
    hist = (t.get("durations") or {}).get("histogram")
    if not hist or not hist.get("counts"):
        return None
    plt = _plt()
    edges, counts = hist["edges_us"], hist["counts"]
    labels = [f"<{edges[k + 1]:g}" if edges[k + 1] != float("inf") else f">={edges[k]:g}" for k in range(len(counts))]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.bar(range(len(counts)), counts, color="#4c72b0")
    ax.set_xticks(range(len(counts)))
    ax.set_xticklabels(labels, rotation=60, fontsize=7)
    ax.set_xlabel("duration (us)")
    ax.set_ylabel("count")
    ax.set_title(f"{'kernel' if t.get('clock') == 'device' else 'op'} durations")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def trace_html(t: dict[str, Any], plot: str = "") -> str:
    """The trace-analysis section's body: temporal / idle breakdown, overlap, launches, durations."""
    if not t:
        return "<p>No trace analysis (the trace could not be read).</p>"
    unit = "stream" if t.get("clock") == "device" else "thread"
    kinds = ("compute", "communication", "memory", "other", "idle")
    temporal = _table(["rank", unit] + [f"{k} %" for k in kinds] + ["window ms"],
                      [[r["rank"], r["stream"]] + [f"{100 * r[k] / (r['span'] or 1):.1f}" for k in kinds]
                       + [f"{r['span'] / 1e3:.3f}"] for r in t.get("temporal", [])], set(range(2, 8)))
    out = [f"<p>Rank {t.get('rank', 0)}, {_esc(t.get('clock'))} clock, window {t.get('span_us', 0) / 1e3:.3f} ms.</p>",
           temporal]
    if t.get("idle"):
        out.append(_table(["stream", "idle ms", "host wait ms", "kernel wait ms", "other ms"],
                          [[r["stream"], f"{r['idle_us'] / 1e3:.3f}", f"{r['host_wait_us'] / 1e3:.3f}",
                            f"{r['kernel_wait_us'] / 1e3:.3f}", f"{r['other_us'] / 1e3:.3f}"] for r in t["idle"]],
                          {1, 2, 3, 4}))
    ov, ln = t.get("overlap"), t.get("launch")
    if ov:
        out.append(f"<p>Communication {ov['communication_us'] / 1e3:.3f} ms, {ov['percent']:.1f}% overlapped with "
                   "compute.</p>")
    if ln:
        out.append(_table(["launch statistic", "value"], [[k, f"{v:.4g}" if isinstance(v, float) else v]
                                                           for k, v in ln.items()]))
    d = t.get("durations") or {}
    if d:
        out.append(plot)
        out.append(_table(["share", "count", "total ms", "mean us", "p50 us", "p90 us", "max us", "name"],
                          [[f"{r['share']:.1%}", r["count"], f"{r['total_us'] / 1e3:.3f}", f"{r['mean_us']:.1f}",
                            f"{r['p50_us']:.1f}", f"{r['p90_us']:.1f}", f"{r['max_us']:.1f}", r["name"]]
                           for r in d.get("by_name", [])], set(range(7))))
    out += [f"<p class=muted>{_esc(n)}</p>" for n in t.get("notes", [])]
    return "\n".join(out)


def _esc(v: Any) -> str:
    return html.escape(str(v))


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(head: list[str], rows: list[list[Any]], num: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in num else ""}>{html.escape(str(v))}</td>'
                                    for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def render_html(p: "Profile", plots: dict[str, Path]) -> str:
    """The report as one HTML string (plots embedded)."""
    e = html.escape
    rate = p.achieved_flops_by_category()
    cat_rows = [[c, f"{p.categories[c] * 1e3:.3f}", f"{p.shares[c]:.1%}",
                 f"{rate[c] / 1e9:.2f}" if c in rate else "-",
                 f"{rate[c] / p.peak_flops:.1%}" if c in rate and p.peak_flops else "-", DESCRIPTIONS.get(c, "")]
                for c in CATEGORIES if c in p.categories]
    op_rows = [[f"{o.share:.1%}", f"{o.time_s * 1e3:.3f}", f"{o.calls:g}", o.name, o.category, o.shapes]
               for o in p.top_ops]
    if p.flops is None:
        flops = "<p>FLOPs were not counted.</p>"
    else:
        rng = p.mfu_range
        mfu = (f"{p.mfu:.1%} of {p.peak_flops / 1e9:.1f} GFLOP/s" + (f" ({rng[1]:.1%} against the median timing)"
                                                                     if rng else "") + f"; peak: {p.peak_source}"
               if p.mfu is not None and p.peak_flops else f"unavailable ({p.peak_source})")
        flops = _table(["item", "value"], [["FLOPs per step", f"{p.flops / 1e9:.4f} GFLOP"],
                                           ["achieved", f"{(p.achieved_flops or 0) / 1e9:.2f} GFLOP/s"],
                                           ["MFU", mfu]])
        flops += _table(["category", "GFLOP per step"],
                        [[c, f"{v / 1e9:.4f}"] for c, v in sorted(p.flops_by_category.items(), key=lambda kv: -kv[1])])
    mem = p.memory
    mem_html = (_table(["item", "MiB"], [["peak", f"{mem.get('peak_bytes', 0) / 2**20:.2f}"]] +
                       [[k, f"{v / 2**20:.2f}"] for k, v in mem.get("by_category", {}).items() if v])
                + f"<p class=muted>{e(str(mem.get('source', '')))}</p>") if mem else "<p>Memory was not tracked.</p>"
    mon = "".join(f"<li><b>{e(k)}</b>: {e(str(v.get('summary', v.get('unavailable', ''))))}</li>"
                  for k, v in p.monitor.items()) or "<li>no monitors ran</li>"
    finds = "".join(f"<li>{e(f)}</li>" for f in p.findings) or "<li>none</li>"
    env = _table(["item", "value"], [[k, v] for k, v in p.environment.items()])
    plots_html = {k: _img(v, k) for k, v in plots.items()}
    u = p.unprofiled_step_time_s
    unprof = (f"; unprofiled {u * 1e3:.3f} ms (mean of {len(p.unprofiled_step_times_s)} plain steps right after), "
              f"profiled / unprofiled {p.profiled_over_unprofiled:.3f} (medians)") if u is not None else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>torchnitro step profile</title><style>{_CSS}</style></head>
<body>
<h1>torchnitro step profile</h1>
<section id="overview"><p><b>{e(p.device)}</b>, {p.clock} clock: {p.steps} recorded steps after {p.warmup} warm-up,
<b>{p.step_time_s * 1e3:.3f} ms</b> per step (min {min(p.step_times_s) * 1e3:.3f}, max {max(p.step_times_s) * 1e3:.3f}){unprof}.
The categories add up to {p.accounted:.1%} of the profiled step.
The trace is <code>trace.json</code> beside this file (open it in ui.perfetto.dev).</p></section>
<section id="categories"><h2>Time by category</h2>{plots_html.get("categories", "")}
{_table(["category", "ms per step", "share", "GFLOP/s", "of peak", "holds"], cat_rows, {1, 2, 3, 4})}</section>
<section id="top-ops"><h2>Top ops (self time)</h2>{plots_html.get("top_ops", "")}
{_table(["share", "ms per step", "calls", "op", "category", "input shapes"], op_rows, {0, 1, 2})}</section>
<section id="flops"><h2>FLOPs and MFU</h2>{flops}</section>
<section id="memory"><h2>Memory</h2>{mem_html}</section>
<section id="monitoring"><h2>Energy and device counters</h2><ul>{mon}</ul></section>
<section id="trace-analysis"><h2>Trace analysis</h2>{trace_html(p.trace_analysis, plots_html.get("durations", ""))}</section>
<section id="findings"><h2>Findings</h2><ul>{finds}</ul></section>
<section id="environment"><h2>Environment</h2>{env}</section>
</body></html>
"""


def write_report(p: "Profile", directory: Path) -> Path:
    """Write every file of a saved profile into ``directory``; returns the report's path."""
    directory.mkdir(parents=True, exist_ok=True)
    if p.trace_path and Path(p.trace_path).exists() and Path(p.trace_path).resolve() != (directory / "trace.json").resolve():
        shutil.copyfile(p.trace_path, directory / "trace.json")
        p.trace_path = str(directory / "trace.json")
    (directory / "profile.json").write_text(p.to_json())
    plots = {"categories": plot_categories(p, directory / "categories.png"),
             "top_ops": plot_top_ops(p, directory / "top_ops.png")}
    durations = plot_durations(p.trace_analysis, directory / "durations.png")
    if durations is not None:
        plots["durations"] = durations
    out = directory / "report.html"
    out.write_text(render_html(p, plots))
    return out
