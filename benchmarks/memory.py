"""Memory benchmark on the reference TransformerLM: checkpointing, planner, finder, FP8.

    flock /tmp/torchnitro-bench.lock python benchmarks/memory.py [--quick] [--threads N]

Writes results/memory_<device>.{json,md} and results/memory_<device>.png. Sections:

1. activation memory (tracker, exact) and train-step time (bench.compare, interleaved) for each
   checkpointing policy (plus ``selective-all-mm``: selective keeping every matmul output); targets: blocks >= 60% less activation memory at <= 30% extra time,
   selective at least halfway between none and blocks in memory at <= 15% extra time;
2. planner error against the tracker over a grid of configs x dtypes x policies (target: < 10%);
3. batch-size finder vs the true limit under a byte budget (target: within one margin, in at most
   2*log2(max_val) trials), from the planner's start and from 1;
4. FP8 (Float8Linear on torch._scaled_mm) vs bf16 step time: GPU with capability >= 8.9 only;
5. zero-copy loading: resident memory a 200 MB safetensors file adds, memory-mapped vs read, before
   and after its tensor is read. Seconds to run: ``--only-zerocopy`` measures just this section and
   puts it into the existing results file, leaving the other sections as they were.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import track as progress

from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir, save_plot
from torchnitro.bench.provenance import provenance
from torchnitro.hardware import hardware_info
from torchnitro.memory import FinderConfig, checkpoint_, find_batch_size, plan, track
from torchnitro.nn.models import TransformerConfig, TransformerLM
from torchnitro.precision import Float8Config, scaled_mm_available, to_float8_

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEL_ALL = "selective-all-mm"


def make_step(cfg: TransformerConfig, batch: int, seq: int, dtype: str = "fp32", policy: object = "none",
              fp8: str | None = None):
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device=DEV, dtype=DT[dtype])
    if policy == SEL_ALL:  # the previous selective default: keep every matmul output
        checkpoint_(model, "selective", recompute=())
    else:
        checkpoint_(model, policy)
    if fp8:  # "ours" (Float8Linear) or "torchao" (torchao.float8 training)
        to_float8_(model, config=Float8Config("dynamic", backend="torchao" if fp8 == "torchao" else "auto"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=DEV == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=DEV)

    def step() -> None:
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def tracked(cfg, batch, seq, dtype="fp32", policy="none", allocator: list | None = None):
    """The tracker's report of one steady-state step; on CUDA with ``allocator`` given, the caching
    allocator's own peak (``torch.cuda.max_memory_allocated``) of one more untracked step, less what was
    allocated before the model was built (earlier sections' leftovers, cuBLAS/cuDNN workspaces), is appended."""
    gc.collect()
    base = torch.cuda.memory_allocated() if allocator is not None and DEV == "cuda" else 0
    model, opt, step = make_step(cfg, batch, seq, dtype, policy)
    step()
    with track(model, opt) as t:
        step()
    if allocator is not None and DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        allocator.append(torch.cuda.max_memory_allocated() - base)
    return t.report()


def checkpointing_section(cfg, batch, seq, tcfg, dtype):
    policies = ["none", "selective", SEL_ALL, "every_2", "blocks"]
    table = ResultTable(f"checkpointing policies ({dtype} TransformerLM D{cfg.dim} L{cfg.n_layers} "
                        f"V{cfg.vocab_size}, batch {batch} x seq {seq}, AdamW train step)",
                        ["policy", "activations MiB", "block activations MiB", "reduction", "peak MiB",
                         "planned peak MiB", "step ms", "extra time", "cv"])
    acts, peaks = {}, {}
    for pol in progress(policies, description="tracking policies"):
        r = tracked(cfg, batch, seq, dtype, pol)
        acts[pol] = r.per_phase["forward"].by_category["activations"]
        peaks[pol] = r.peak.bytes
    head = plan(cfg, batch=batch, seq=seq, dtype=dtype, device=DEV).term("activations/head")
    steps = {pol: make_step(cfg, batch, seq, dtype, pol)[2] for pol in policies}
    times = compare(steps, tcfg, baseline="none")
    rows = {}
    for pol in policies:
        block = acts[pol] - head
        rows[pol] = dict(
            policy=pol, **{"activations MiB": acts[pol] / 2**20, "block activations MiB": block / 2**20,
                           "reduction": 1 - block / (acts["none"] - head), "peak MiB": peaks[pol] / 2**20,
                           "planned peak MiB": None if pol == SEL_ALL else plan(
                               cfg, batch=batch, seq=seq, dtype=dtype, checkpointing=pol, foreach=DEV == "cuda",
                               device=DEV).peak_bytes / 2**20,
                           "step ms": times[pol].median * 1e3,
                           "extra time": times[pol].median / times["none"].median - 1, "cv": times[pol].cv})
        table.add(**rows[pol])
    b_none, b_blk = (acts["none"] - head), (acts["blocks"] - head)
    sel = acts["selective"] - head
    table.meta["targets"] = ("blocks: reduction >= 60% at extra time <= 30%; selective: block activations <= "
                             "midpoint of none and blocks at extra time <= 15%")
    table.meta["blocks met"] = rows["blocks"]["reduction"] >= 0.6 and rows["blocks"]["extra time"] <= 0.30
    table.meta["selective met"] = sel <= (b_none + b_blk) / 2 and rows["selective"]["extra time"] <= 0.15
    table.meta["selective position"] = f"{(b_none - sel) / (b_none - b_blk):.0%} of the way from none to blocks"
    return table, rows


GRID = [
    (dict(vocab_size=2048, dim=256, n_layers=4, n_heads=4, max_seq_len=512), 4, 256),
    (dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=512), 4, 256),
    (dict(vocab_size=8192, dim=256, n_layers=2, n_heads=4, max_seq_len=512), 2, 128),
    (dict(vocab_size=1024, dim=192, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=512), 3, 200),
    (dict(vocab_size=4096, dim=96, n_layers=2, n_heads=3, max_seq_len=512), 1, 32),
]


def planner_section(quick: bool):
    table = ResultTable("planner vs tracker (peak bytes of a steady-state AdamW step)",
                        ["config", "dtype", "policy", "attention", "measured MiB", "planned MiB", "error", "phase"]
                        + (["allocator MiB", "error vs allocator"] if DEV == "cuda" else []))
    grid = GRID[1:3] if quick else GRID
    cases = [(c, b, t, dt, pol) for c, b, t in grid for dt in ("fp32", "bf16")
             for pol in ("none", "blocks", "selective", "every_2")]
    worst, worst_alloc = 0.0, 0.0
    for c, b, t, dt, pol in progress(cases, description="planner grid"):
        cfg = TransformerConfig(**c)
        alloc: list[int] = []
        r = tracked(cfg, b, t, dt, pol, allocator=alloc)
        p = plan(cfg, batch=b, seq=t, dtype=dt, checkpointing=pol, foreach=DEV == "cuda", device=DEV)
        err = p.peak_bytes / r.peak.bytes - 1
        worst = max(worst, abs(err))
        table.add(config=f"D{cfg.dim} L{cfg.n_layers} H{cfg.n_heads}/{cfg.kv_heads} V{cfg.vocab_size} B{b} T{t}",
                  dtype=dt, policy=pol, attention=p.inputs["attention"],
                  **{"measured MiB": r.peak.bytes / 2**20, "planned MiB": p.peak_bytes / 2**20,
                     "error": err, "phase": f"{r.peak.phase}/{p.peak_phase}"},
                  **({"allocator MiB": alloc[0] / 2**20, "error vs allocator": p.peak_bytes / alloc[0] - 1}
                     if alloc else {}))
        if alloc:
            worst_alloc = max(worst_alloc, abs(p.peak_bytes / alloc[0] - 1))
    table.meta["worst |error|"] = f"{worst:.1%} (target < 10%)"
    if DEV == "cuda":
        table.meta["worst |error| vs the CUDA caching allocator"] = (
            f"{worst_alloc:.1%} (torch.cuda.max_memory_allocated of one more steady-state step less "
            "torch.cuda.memory_allocated before the model was built; the allocator rounds every block to 512 bytes)")
    return table, worst


def finder_section(quick: bool):
    cfg = TransformerConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    seq, max_val, margin = 32, 256, 0.05
    model, opt, _ = make_step(cfg, 1, seq)
    data = torch.randint(0, cfg.vocab_size, (max_val, seq), device=DEV)

    def step(b: int) -> None:
        F.cross_entropy(model(data[:b]).flatten(0, 1).float(), data[:b].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def est(b: int) -> int:
        return plan(cfg, batch=b, seq=seq, foreach=DEV == "cuda", device=DEV).peak_bytes

    step(1)  # CUDA: the cuBLAS workspace and optimizer state exist before the first trial

    table = ResultTable("batch-size finder vs true limit", ["budget MiB", "start", "mode", "found", "true limit",
                                                            "within margin", "trials", "trial bound"])
    budgets = [4, 8] if quick else [4, 8, 16]
    for mib in progress(budgets, description="finder"):
        budget = mib * 2**20
        truth = find_batch_size(step, FinderConfig(budget_bytes=budget, margin=1e-9, max_val=max_val), model=model,
                                optimizer=opt).batch_size  # bisect to hi - lo == 1: the exact limit
        for start, kw in (("planner", dict(estimate=est)), ("1", {})):
            r = find_batch_size(step, FinderConfig(budget_bytes=budget, margin=margin, max_val=max_val), model=model,
                                optimizer=opt, **kw)
            table.add(**{"budget MiB": mib, "start": f"{start} ({r.start})", "mode": "binsearch",
                         "found": r.batch_size, "true limit": truth,
                         "within margin": truth - r.batch_size <= max(1, margin * r.batch_size),
                         "trials": r.n_trials, "trial bound": int(2 * math.log2(max_val))})
    return table


def fp8_section(tcfg):
    table = ResultTable("FP8 vs bf16 train step", ["config", "bf16 ms", "fp8 ms", "speedup", "torchao fp8 ms",
                                                    "torchao speedup", "note"])
    if not scaled_mm_available():
        table.add(config="-", note="not measured: needs a CUDA GPU with capability >= 8.9 (H100); "
                                   "this machine has none. The emulated path is for numerics, not speed.")
        return table
    for dim, L, B, T in ((2048, 4, 8, 1024), (4096, 2, 4, 1024)):
        cfg = TransformerConfig(vocab_size=32768, dim=dim, n_layers=L, n_heads=dim // 128, max_seq_len=T)
        fns = {"bf16": make_step(cfg, B, T, "bf16")[2], "fp8": make_step(cfg, B, T, "bf16", fp8="ours")[2]}
        try:
            fns["torchao"] = make_step(cfg, B, T, "bf16", fp8="torchao")[2]
        except Exception as exc:  # noqa: BLE001 - torchao missing or unsupported: reported, not fatal
            note = f"torchao not compared: {exc}"
        else:
            note = "torchao.float8 convert_to_float8_training, same module filter"
        r = compare(fns, tcfg, baseline="bf16")
        ao = r.get("torchao")
        table.add(config=f"D{dim} L{L} B{B} T{T}", **{
            "bf16 ms": r["bf16"].median * 1e3, "fp8 ms": r["fp8"].median * 1e3,
            "speedup": r["bf16"].median / r["fp8"].median,
            "torchao fp8 ms": ao.median * 1e3 if ao else None,
            "torchao speedup": r["bf16"].median / ao.median if ao else None},
            note="Float8Linear dynamic scaling on torch._scaled_mm, lm_head in bf16; " + note)
    return table


def zerocopy_section(size_mb: int = 200) -> ResultTable:
    """Resident memory (RSS) a safetensors file of ``size_mb`` MB adds when loaded memory-mapped or read,
    right after loading and after half / all of its tensor has been read."""
    from safetensors.torch import save_file

    from torchnitro.memory.zerocopy import load_weights, resident_bytes

    t = ResultTable(f"zero-copy loading ({size_mb} MB safetensors file, one fp32 tensor, file in the page cache)",
                    ["load", "after", "resident MiB added"],
                    meta={**provenance("benchmarks/memory.py", device="cpu"),
                          "measure": "RSS from /proc/self/statm (torchnitro.memory.zerocopy.resident_bytes) "
                                     "minus RSS before the load"})
    n = size_mb * 10**6 // 4
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.safetensors"
        save_file({"w": torch.ones(n)}, str(path))
        for mmap in (True, False):
            gc.collect()
            base = resident_bytes()
            state = load_weights(path, mmap=mmap)
            label = "load_weights(mmap=True)" if mmap else "load_weights(mmap=False)"
            t.add(load=label, after="loading", **{"resident MiB added": (resident_bytes() - base) / 2**20})
            state["w"][: n // 2].sum().item()  # reads (pages in) the first half
            t.add(load=label, after="reading half", **{"resident MiB added": (resident_bytes() - base) / 2**20})
            state["w"].sum().item()
            t.add(load=label, after="reading all", **{"resident MiB added": (resident_bytes() - base) / 2**20})
            del state
    return t


def write_results(name: str, meta: dict, sections: list[ResultTable]) -> None:
    """results/<name>.json (meta + every section's table) and results/<name>.md (the same, readable)."""
    d = results_dir()
    (d / f"{name}.json").write_text(json.dumps({"meta": meta, "sections": [t.to_json() for t in sections]},
                                               indent=2, default=str))
    (d / f"{name}.md").write_text("\n".join([f"# memory benchmark ({DEV})", ""] + [f"- {k}: {v}" for k, v in meta.items()]
                                            + [""] + [t.to_markdown() for t in sections]))


def add_zerocopy_only(name: str, size_mb: int = 200) -> None:
    """Measure the zero-copy section and put it into the saved results, replacing an older one."""
    path = results_dir() / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {"meta": {}, "sections": []}
    sections = [ResultTable(s["title"], s["columns"], s["rows"], s["meta"]) for s in data["sections"]
                if not s["title"].startswith("zero-copy loading")]
    zc = zerocopy_section(size_mb)
    zc.meta.setdefault("written", time.strftime("%Y-%m-%d %H:%M:%S"))
    zc.print()
    write_results(name, data["meta"], sections + [zc])


def plot(rows_by_dtype, planner_rows, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.4
    pols: list[str] = []
    for k, (dt, rows) in enumerate(rows_by_dtype.items()):
        pols = list(rows)
        xs = [i + (k - 0.5) * width for i in range(len(pols))]
        a1.bar(xs, [rows[p]["block activations MiB"] for p in pols], width, label=dt)
        a2.bar(xs, [rows[p]["extra time"] * 100 for p in pols], width, label=dt)
    for ax, title, ylabel in ((a1, "activation memory of the blocks", "MiB"),
                              (a2, "extra train-step time vs none", "%")):
        ax.set_xticks(range(len(pols)), pols, rotation=15)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
    a2.axhline(30, ls="--", c="k", lw=0.8)
    a2.axhline(15, ls=":", c="k", lw=0.8)
    # markers, not bars: errors of 0.01% would be invisible bars on a +-10% axis
    errs = [r["error"] * 100 for r in planner_rows]
    a3.plot(range(len(errs)), errs, "o", color="tab:green", label="vs torchnitro's tracker")
    alloc = [r["error vs allocator"] * 100 for r in planner_rows if "error vs allocator" in r]
    if alloc:
        a3.plot(range(len(alloc)), alloc, "x", color="tab:blue", ms=8, label="vs the CUDA caching allocator")
    a3.axhline(10, ls="--", c="k", lw=0.8)
    a3.axhline(-10, ls="--", c="k", lw=0.8)
    a3.axhline(0, c="grey", lw=0.5)
    span = max([1.0] + [abs(e) * 1.3 for e in errs + alloc])
    a3.set_ylim(-span, span)
    a3.set_ylabel("% (target band +-10%, dashed)" if span > 10 else "% (target +-10%)")
    a3.set_xlabel("grid case (config x dtype x policy)")
    a3.legend(loc="lower right", fontsize=8)
    a3.set_title("planner error vs measured peak")
    fig.tight_layout()
    save_plot(fig, name)


def replot(name: str) -> None:
    """Redraw the PNG from a saved results JSON (no measuring)."""
    import json

    from torchnitro.bench import results_dir

    data = json.loads((results_dir() / f"{name}.json").read_text())
    secs = data["sections"]
    ck = {("bf16" if "bf16" in t["title"] else "fp32"): {r["policy"]: r for r in t["rows"]}
          for t in secs if t["title"].startswith("checkpointing")}
    pl = next(t["rows"] for t in secs if t["title"].startswith("planner"))
    plot(ck, pl, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller grid and shorter timing")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads; 1 on a shared box keeps OpenMP barriers from stalling")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the saved JSON")
    ap.add_argument("--only-zerocopy", action="store_true",
                    help="measure only the zero-copy loading section (seconds) and add it to the saved results")
    args = ap.parse_args()
    if args.replot:
        replot(f"memory_{DEV}")
        return 0
    if args.only_zerocopy:
        add_zerocopy_only(f"memory_{DEV}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tcfg = TimingConfig(min_iters=5, min_time_s=1.0, max_time_s=20.0) if args.quick else \
        TimingConfig(min_iters=25, min_time_s=5.0, max_time_s=60.0)
    hw = hardware_info()
    machine = hw.gpu_name or f"{hw.cpu_name}, {hw.cpu_cores} cores, flags {' '.join(hw.cpu_flags)}"
    cfg = TransformerConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, max_seq_len=512)
    ck32, rows32 = checkpointing_section(cfg, 4, 256, tcfg, "fp32")
    ck16, rows16 = checkpointing_section(cfg, 4, 256, tcfg, "bf16")
    pl, _ = planner_section(args.quick)
    fi = finder_section(args.quick)
    f8 = fp8_section(tcfg)
    zc = zerocopy_section()
    name = f"memory_{DEV}"
    meta = {**provenance("benchmarks/memory.py", device=DEV), "machine": machine}
    meta["command"] = "flock /tmp/torchnitro-bench.lock " + meta["command"]
    sections = [ck32, ck16, pl, fi, f8, zc]
    for t in sections:
        t.meta.setdefault("machine", machine)
        t.print()
    write_results(name, meta, sections)
    plot({"fp32": rows32, "bf16": rows16}, pl.rows, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
