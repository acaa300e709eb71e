"""Full ``torchnitro.optimize`` searches on CPU: built-in models and the real all-MiniLM-L6-v2.

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/optimize_cpu.py            # everything
    flock /tmp/torchnitro-bench.lock python benchmarks/optimize_cpu.py --only minilm-b32

For each workload: a full search (fresh cache directory), then the same call again (cached re-run),
and a table of every candidate (status, p50/p99, speedup vs eager from the search's interleaved
comparison, min cosine). For MiniLM the gate adds the issue's metric: the minimum cosine over
sentence embeddings (``row_cosine``) must be >= 0.99. A last table times eager against the chosen
MiniLM variant side by side on realistic sentences and on full-length (unpadded) text, since a
padding-aware variant's speedup depends on how much of the batch is padding.

Writes results/optimize_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

from torchnitro.autotune.api import optimize
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.inputs import model_and_inputs
from torchnitro.autotune.recipes.int8_mixed import row_cosine
from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir, save_plot
from torchnitro.bench.provenance import provenance
from torchnitro.hardware import hardware_info

# name -> (model spec, batch, seq, budget_s, MiniLM embedding gate)
WORKLOADS = {
    "minilm-b32": ("minilm", 32, 128, 140.0, True),
    "minilm-b1": ("minilm", 1, 16, 100.0, True),
    "encoder": ("encoder", 8, 128, 120.0, False),
    "lm": ("lm", 4, 128, 120.0, False),
    "cnn": ("cnn", 16, 0, 120.0, False),
    "mlp": ("mlp", 64, 0, 90.0, False),
}
COLUMNS = ("workload", "recipe", "class", "status", "median ms", "p99 ms", "speedup", "timed", "min cosine", "build s",
           "why")


def run(name: str, cache_root: Path) -> tuple[list[dict], dict, object, tuple]:
    spec, batch, seq, budget, emb_gate = WORKLOADS[name]
    model, inputs, info = model_and_inputs(spec, batch=batch, seq=seq)
    cfg = OptimizeConfig(budget_s=budget, candidate_timeout_s=min(120.0, budget), cache_dir=str(cache_root / name),
                         metric_fn=row_cosine if emb_gate else None, metric_threshold=0.99 if emb_gate else None)
    # default finalists (3): the search screens every candidate within 2x of the best estimate first
    t0 = time.perf_counter()
    opt = optimize(model, inputs, cfg, info=info)
    full_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = optimize(model, inputs, cfg, info=info)
    cached_s = time.perf_counter() - t0
    rows = []
    for c in opt.report.candidates:
        cos = c.metric if emb_gate and c.metric is not None else c.min_cosine
        rows.append({"workload": name, "recipe": c.recipe, "class": c.numeric_class, "status": c.status,
                     "median ms": c.p50_ms, "p99 ms": c.p99_ms, "speedup": c.speedup,
                     "timed": "interleaved" if c.interleaved else ("search estimate" if c.speedup else None),
                     "min cosine": cos,
                     "build s": c.build_s, "why": (c.reason or c.notes)[:90]})
    summary = {"workload": name, "inputs": opt.report.inputs, "chosen": opt.recipe, "full_search_s": full_s,
               "cached_rerun_s": cached_s, "cached_chosen": again.recipe,
               "chosen_speedup": opt.report.get(opt.recipe).speedup, "objective": opt.report.objective}
    return rows, summary, opt, (model, inputs)


def _variants(opt: object, model: torch.nn.Module, x: tuple, cfg: OptimizeConfig,
              names: tuple[str, ...] = ("bert-unpad", "bert-unpad-int8", "bf16")) -> dict[str, object]:
    """eager, the chosen variant, and the encoder recipes built directly, to time side by side."""
    from torchnitro.autotune.recipe import BuildContext, get_recipe

    out: dict[str, object] = {"eager": model, f"chosen ({opt.recipe})": opt}
    for name in names:
        if name == opt.recipe:
            continue
        with tempfile.TemporaryDirectory() as wd:
            ctx = BuildContext(model=copy.deepcopy(model), example_inputs=x, hardware=hardware_info(),
                               device=torch.device("cpu"), workdir=Path(wd), dynamic_dims={0: [0, 1], 1: [0, 1]},
                               config=cfg)
            out[name] = get_recipe(name).build(ctx).fn
    return out


def padding_table(opt: object, model: torch.nn.Module, rounds: int = 12) -> ResultTable:
    """Eager vs the chosen MiniLM variant (and the encoder recipes), interleaved in one run, on
    realistic sentences and on full-length text."""
    from torchnitro.hf import minilm_inputs, sample_sentences, tokenize

    t = ResultTable("MiniLM b32x128: variants side by side (one interleaved run per input set)",
                    ("inputs", "real tokens", "variant", "median ms", "min ms", "p99 ms", "speedup", "speedup (min)",
                     "min cosine (held-out)"))
    full = lambda seed: tokenize(sample_sentences(32, seed, min_words=150, max_words=200), "minilm", 128)  # noqa: E731
    sets = {"realistic sentences": (minilm_inputs(32, 128, 0), [minilm_inputs(32, 128, s) for s in (501, 502)]),
            "full-length text": (full(0), [full(501), full(502)])}
    cfg = TimingConfig(warmup=2, min_iters=rounds, min_time_s=4.0, max_time_s=150.0)
    variants = _variants(opt, model, sets["realistic sentences"][0],
                         OptimizeConfig(metric_fn=row_cosine, metric_threshold=0.99))
    for label, (x, held) in sets.items():
        with torch.inference_mode():
            refs = [model(*h) for h in held]
            cos = {n: min(row_cosine(r, f(*h)) for h, r in zip(held, refs)) for n, f in variants.items()}
            res = compare({n: (lambda f=f: f(*x)) for n, f in variants.items()}, cfg, items_per_call=32)
        real = f"{float(x[1].float().mean()):.0%}"
        for v, tm in res.items():
            t.add(**{"inputs": label, "real tokens": real, "variant": v, "median ms": tm.median * 1e3,
                     "min ms": tm.min * 1e3, "p99 ms": tm.p99 * 1e3, "speedup": res["eager"].median / tm.median,
                     "speedup (min)": res["eager"].min / tm.min, "min cosine (held-out)": cos[v]})
    return t


def plot(rows: list[dict], path_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows}, key=list(WORKLOADS).index)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
    for ax, n in zip(axes[0], names):
        rs = [r for r in rows if r["workload"] == n and r["speedup"]]
        colors = ["tab:green" if r["status"] == "chosen" else "tab:blue" if r["status"] == "verified" else "tab:red"
                  for r in rs]
        bars = ax.barh([r["recipe"] for r in rs], [r["speedup"] for r in rs], color=colors)
        for bar, r in zip(bars, rs):
            if r.get("timed") != "interleaved":  # one search-time sample: hatched, lighter
                bar.set_hatch("//")
                bar.set_alpha(0.45)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(n)
    fig.supxlabel("speedup vs eager (green: chosen; hatched: one search-time sample, not interleaved)")
    fig.tight_layout()
    save_plot(fig, path_name)


def variants_only(rounds: int) -> None:
    """The MiniLM side-by-side table alone: a full search (fresh cache) picks the variant, then eager,
    the chosen one and the encoder recipes are timed interleaved for ``rounds`` rounds per input set."""
    with tempfile.TemporaryDirectory(prefix="torchnitro-bench-cache-") as cache_root:
        _, summary, opt, (model, _) = run("minilm-b32", Path(cache_root))
    t = padding_table(opt, model, rounds)
    t.meta.update(command=f"flock /tmp/torchnitro-bench.lock python benchmarks/optimize_cpu.py --variants {rounds}",
                  machine=_machine(), search=json.dumps({k: summary[k] for k in ("chosen", "full_search_s")}, default=str))
    t.save("optimize_cpu_minilm_variants")
    t.print()


def _gemm_fns(threads: int) -> dict[str, object]:
    """One MiniLM FFN GEMM, (4096, 384) @ (384, 1536), through each CPU path torch offers."""
    import torch.nn.functional as F

    n, k, m = 32 * 128, 384, 1536
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, generator=g)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    xh, wh, bh = x.half(), w.half(), b.half()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, n)  # what inductor's freezing does for bf16 Linear
    lin = torch.nn.Linear(k, m)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w, b)

    return {"fp32 F.linear (MKL sgemm)": lambda: F.linear(x, w, b),
            "bf16 F.linear (oneDNN brgemm)": lambda: F.linear(xb, wb, bb),
            "bf16 oneDNN, weight prepacked": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, bb, "none", [], ""),
            "bf16 autocast on fp32 tensors": autocast,
            "fp16 F.linear (oneDNN avx512_fp16)": lambda: F.linear(xh, wh, bh),
            "int8 dynamic (fbgemm VNNI)": lambda: q(x)}


def _minilm_fns() -> tuple[dict[str, object], tuple]:
    from torchnitro.hf import load_minilm, minilm_inputs

    model = load_minilm().eval()
    x = minilm_inputs(32, 128, 0)
    cast = copy.deepcopy(model).to(torch.bfloat16)

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*x)

    v = _variants(type("O", (), {"recipe": "-"})(), model, x,
                  OptimizeConfig(metric_fn=row_cosine, metric_threshold=0.99),
                  names=("bert-unpad", "bert-unpad-bf16", "bert-unpad-int8"))
    fns = {"eager fp32": lambda: model(*x), "model cast to bf16": lambda: cast(*x),
           "eager under bf16 autocast": autocast}
    fns.update({name: (lambda f=f: f(*x)) for name, f in v.items() if name not in ("eager", "chosen (-)")})

    def grad_on(f: object) -> object:  # a caller that forgot torch.no_grad()/inference_mode(): autograd records
        def call() -> object:
            with torch.inference_mode(False), torch.enable_grad():
                return f()
        return call

    fns["eager fp32, autograd on"] = grad_on(fns["eager fp32"])
    fns["model cast to bf16, autograd on"] = grad_on(fns["model cast to bf16"])
    return fns, x


def bf16_tables() -> None:
    """Why bf16 is slower than fp32 on this CPU: one GEMM through every path, then MiniLM, side by side."""
    from torchnitro.hardware import hardware_info as hwi

    hw = hwi()
    flops = 2 * 4096 * 384 * 1536
    t = ResultTable("bf16 on this CPU: one MiniLM FFN GEMM (4096x384 @ 384x1536), interleaved per thread count",
                    ("threads", "path", "median ms", "min ms", "GFLOP/s (min)", "vs fp32 (median)"))
    cfg = TimingConfig(warmup=3, min_iters=15, min_time_s=2.0, max_time_s=60.0)
    old = torch.get_num_threads()
    try:
        for threads in (1, hw.cpu_cores):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                res = compare(_gemm_fns(threads), cfg)
            base = next(iter(res.values()))
            for path, tm in res.items():
                t.add(threads=threads, path=path, **{"median ms": tm.median * 1e3, "min ms": tm.min * 1e3,
                      "GFLOP/s (min)": flops / tm.min / 1e9, "vs fp32 (median)": base.median / tm.median})
    finally:
        torch.set_num_threads(old)
    fns, _ = _minilm_fns()
    with torch.inference_mode():
        res = compare(fns, TimingConfig(warmup=2, min_iters=10, min_time_s=3.0, max_time_s=120.0), items_per_call=32)
    m = ResultTable("MiniLM 32x128 (73% real tokens) in bf16, side by side", ("variant", "median ms", "min ms",
                                                                             "vs eager (median)", "vs eager (min)"))
    for name, tm in res.items():
        m.add(variant=name, **{"median ms": tm.median * 1e3, "min ms": tm.min * 1e3,
                               "vs eager (median)": res["eager fp32"].median / tm.median,
                               "vs eager (min)": res["eager fp32"].min / tm.min})
    cmd = "flock /tmp/torchnitro-bench.lock python benchmarks/optimize_cpu.py --bf16"
    t.meta.update(command=cmd, machine=_machine(), amx="amx_bf16" in hw.cpu_flags)
    d = results_dir()
    (d / "optimize_cpu_bf16.md").write_text(t.to_markdown() + "\n" + m.to_markdown())
    (d / "optimize_cpu_bf16.json").write_text(json.dumps({"gemm": t.to_json(), "minilm": m.to_json()}, indent=2,
                                                         default=str))
    _bf16_plot(t, m)
    t.print()
    m.print()


def _bf16_plot(gemm: ResultTable, minilm: ResultTable) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    top = max(r["threads"] for r in gemm.rows)
    rows = [r for r in gemm.rows if r["threads"] == top]
    axes[0].barh([r["path"] for r in rows], [r["vs fp32 (median)"] for r in rows])
    axes[0].set_title(f"one GEMM, {top} threads: speed vs fp32")
    axes[1].barh([r["variant"] for r in minilm.rows], [r["vs eager (median)"] for r in minilm.rows], color="tab:green")
    axes[1].set_title("MiniLM 32x128: speed vs eager fp32")
    for ax in axes:
        ax.axvline(1.0, color="k", lw=0.8)
    fig.tight_layout()
    save_plot(fig, "optimize_cpu_bf16")


def _machine() -> str:
    hw = hardware_info()
    return f"{hw.cpu_name}, {hw.cpu_cores} cores, flags {' '.join(hw.cpu_flags)}, torch {torch.__version__}"


# the runtimes the recipes run on, for the results header
_PACKAGES = ("torch", "numpy", "onnxruntime", "onnx", "openvino", "nncf", "transformers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="run only these workloads")
    ap.add_argument("--variants", type=int, default=0, metavar="ROUNDS",
                    help="only the MiniLM side-by-side table, with this many interleaved rounds; writes "
                         "results/optimize_cpu_minilm_variants.{json,md}")
    ap.add_argument("--bf16", action="store_true", help="only the bf16 investigation: one GEMM through every CPU "
                    "path and MiniLM in bf16, side by side; writes results/optimize_cpu_bf16.{json,md}")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.bf16:
        bf16_tables()
        return
    if args.variants:
        variants_only(args.variants)
        return
    names = args.only or list(WORKLOADS)
    machine = _machine()
    all_rows, summaries, extra = [], [], None
    with tempfile.TemporaryDirectory(prefix="torchnitro-bench-cache-") as cache_root:
        for name in names:
            rows, summary, opt, (model, _) = run(name, Path(cache_root))
            all_rows += rows
            summaries.append(summary)
            print(json.dumps(summary))
            if name == "minilm-b32":
                extra = padding_table(opt, model)
    table = ResultTable("torchnitro optimize on CPU: every candidate", COLUMNS, all_rows,
                        meta={"machine": machine, "command": "flock /tmp/torchnitro-bench.lock python "
                              "benchmarks/optimize_cpu.py" + (f" --only {' '.join(args.only)}" if args.only else ""),
                              "gate (minilm)": "min cosine of sentence embeddings >= 0.99, plus the class gate"})
    st = ResultTable("search time and chosen variant", ("workload", "inputs", "chosen", "chosen_speedup",
                                                        "full_search_s", "cached_rerun_s", "cached_chosen"),
                     [{k: s[k] for k in ("workload", "inputs", "chosen", "chosen_speedup", "full_search_s",
                                         "cached_rerun_s", "cached_chosen")} for s in summaries],
                     meta={**provenance("benchmarks/optimize_cpu.py", packages=_PACKAGES),
                           "targets": "full search <= 180 s, cached re-run <= 20 s"})
    d = results_dir()
    table.save("optimize_cpu")
    md = st.to_markdown() + "\n" + (extra.to_markdown() + "\n" if extra else "") + table.to_markdown()
    (d / "optimize_cpu.md").write_text(md)
    data = {"candidates": table.to_json(), "summary": st.to_json(), "padding": extra.to_json() if extra else None}
    (d / "optimize_cpu.json").write_text(json.dumps(data, indent=2, default=str))
    plot(all_rows, "optimize_cpu")
    st.print()
    if extra:
        extra.print()
    table.print()


if __name__ == "__main__":
    main()
