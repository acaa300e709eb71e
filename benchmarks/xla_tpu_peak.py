"""What the TPU compile keeps live at its peak, and the liveness walk under each gradient-sync model.

    python benchmarks/xla_tpu_peak.py results/xla_tpu_fsdp_buffers.json [more --buffers JSONs] --out results

Reads the XLA dumps that an earlier ``benchmarks/xla_tpu.py --buffers DIR`` run kept (each row's
``xla_dump``; rows whose dump is gone are listed as such) with ``torchnitro.xla.dump.read_schedule``:
where XLA's peak falls in its schedule, the JAX operations the values live there come from, and how
the gradients are synchronised (all-reduces of the backward; ``while`` loops of gradient matmuls,
i.e. reduce-scatter collective matmuls, and how many of them run after the peak). Beside it, the
walk (``torchnitro.xla.estimate.simulated_temp``) under each ``grad_sync`` model of
``torchnitro.xla.liveness``. Nothing is compiled. Writes results/xla_tpu_peak.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.xla.liveness import GRAD_SYNC  # noqa: E402
from torchnitro.xla.model import LMConfig  # noqa: E402

MIB = 1024**2


def _label(op_name: str) -> str:
    """The last two parts of a JAX op_name ("rematted_computation/mul"), or the whole when short."""
    parts = [p for p in op_name.split("/") if p]
    return "/".join(parts[-2:]) if parts else "(parameter or unnamed)"


def _groups(peak, top: int = 5) -> list[tuple[str, int, int]]:
    """(label, count, bytes) of the peak's values by source, largest total first."""
    by: dict[str, list[int]] = {}
    for v in peak:
        if v.first == 0:  # parameters and constants live from the start: not temp
            continue
        g = by.setdefault(_label(v.source), [0, 0])
        g[0], g[1] = g[0] + 1, g[1] + v.bytes
    return sorted(((k, c, b) for k, (c, b) in by.items()), key=lambda t: -t[2])[:top]


def _walks(base: LMConfig, r: dict) -> dict[str, int]:
    import optax

    from torchnitro.xla.estimate import simulated_temp
    from torchnitro.xla.lm import lm_train_step
    from torchnitro.xla.mesh import make_mesh

    cfg = dataclasses.replace(base, attention=r.get("attention", "plain"))
    mesh = make_mesh("x".join(str(v) for v in r["mesh"].values()), target=r["target"])
    step = lm_train_step(cfg, optax.adamw(1e-3), mesh, r["rules"], r["batch"], r["seq"], remat=r["remat"])
    return {m: simulated_temp(cfg, step, r["batch"], r["seq"], r["remat"], m).heap for m in GRAD_SYNC}


def _row(base: LMConfig, r: dict) -> dict:
    from torchnitro.xla.dump import read_schedule

    out = {k: r[k] for k in ("target", "mesh", "rules", "remat", "attention", "batch", "seq", "temp")}
    out |= dict(model=dataclasses.asdict(base), xla_hbm_temp=r.get("xla_hbm_temp"), walk=_walks(base, r))
    try:
        s = read_schedule(r["xla_dump"])
    except Exception as exc:  # a dump that is gone or unreadable is reported, never fatal to the table
        return out | dict(schedule_error=f"{type(exc).__name__}: {exc}"[:300])
    last_ar = max(s.grad_all_reduces, key=lambda t: t[1], default=(-1, 0))
    return out | dict(length=s.length, peak_step=s.peak_step, groups=_groups(s.peak), gathers=s.gathers,
                      largest_grad_all_reduce=last_ar, n_grad_all_reduces=len(s.grad_all_reduces),
                      grad_loops=len(s.grad_loops), grad_loops_after_peak=sum(p > s.peak_step for p in s.grad_loops))


def _md(rows: list[dict]) -> str:
    pct = lambda a, b: f"{100 * (a / b - 1):+.0f}%" if b else "n/a"  # noqa: E731
    out = ["# What the TPU compile keeps at its peak (from XLA's dumps), and the walk's gradient-sync models",
           "", "MiB per device. **peak at**: XLA's peak step over its schedule length. **gradient sync in the compile**: "
           "the largest all-reduce of the backward (MiB at its position; XLA's combiner merges the gradients' "
           "all-reduces into it) and the gradient matmuls compiled as `while` loops (reduce-scatter collective "
           "matmuls), with how many run after the peak. **walk**: `simulated_temp` under grad_sync scatter / "
           "combined / deferred (`torchnitro.xla.liveness.simulate`), error against memory_analysis temp and "
           "[against XLA's HBM temp allocation]. **at XLA's peak**: count x source (the JAX op, last two parts), "
           "MiB; parameters left out.", "",
           "| target | model | rules | remat | attention | batch | memory_analysis temp | HBM alloc | peak at | gradient "
           "sync in the compile | walk scatter | walk combined | walk deferred | at XLA's peak |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["model"]
        w, hbm = r["walk"], r.get("xla_hbm_temp") or 0
        cells = [f"{w[k] / MIB:.1f} ({pct(w[k], r['temp'])} [{pct(w[k], hbm)}])" for k in GRAD_SYNC]
        if "schedule_error" in r:
            sync, at, grp = r["schedule_error"], "", ""
        else:
            pos, b = r["largest_grad_all_reduce"]
            sync = (f"all-reduce {b / MIB:.1f} MiB at {pos}" if pos >= 0 else "no gradient all-reduce") + \
                f"; {r['grad_loops']} matmul loops ({r['grad_loops_after_peak']} after the peak)"
            at = f"{r['peak_step']} / {r['length']}"
            grp = "; ".join(f"{c}x {k}: {b / MIB:.1f}" for k, c, b in r["groups"])
        out.append(f"| {r['target']} | {m['n_layers']}x{m['dim']} | {r['rules']} | {r['remat']} | {r['attention']} | "
                   f"{r['batch']} | {r['temp'] / MIB:.1f} | {hbm / MIB:.1f} | {at} | {sync} | " + " | ".join(cells) + f" | {grp} |")
    read = [r for r in rows if "schedule_error" not in r]
    loops = [f"{r['target']} {r['model']['n_layers']}x{r['model']['dim']} {r['rules']} {r['remat']} {r['attention']} "
             f"B={r['batch']}" for r in read if r["grad_loops"]]
    out += ["", f"Gradient synchronisation in the {len(read)} compiles read: {len(read) - len(loops)} by all-reduces "
            f"only, {len(loops)} with gradient matmul loops ({'; '.join(loops) or 'none'})."]
    gathers: dict[str, int] = {}
    for r in read:
        for k, c in r.get("gathers", {}).items():
            gathers[k] = gathers.get(k, 0) + c
    out += ["", "All-gathers in those compiles by element type and the JAX op they serve: " +
            ", ".join(f"{k}: {c}" for k, c in sorted(gathers.items(), key=lambda t: -t[1])) + "."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by benchmarks/xla_tpu.py --buffers")
    ap.add_argument("--out", default=os.environ.get("TORCHNITRO_RESULTS", "results"))
    args = ap.parse_args()
    rows = []
    for path in args.runs:
        data = json.load(open(path))
        base = LMConfig(**data["model"])
        for r in data["rows"]:
            if r["target"] != "host" and r.get("xla_dump"):
                rows.append(_row(base, r))
                print(f"{r['rules']} {r['remat']} {r.get('attention')} B={r['batch']}", file=sys.stderr, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "xla_tpu_peak.json"), "w") as f:
        json.dump(dict(runs=args.runs, rows=rows), f, indent=1)
    md = _md(rows)
    title, rest = md.split("\n", 1)
    head = provenance("benchmarks/xla_tpu_peak.py", packages=("jax", "jaxlib", "libtpu"))
    md = title + "\n\n" + "".join(f"- {k}: {v}\n" for k, v in head.items()) + rest
    with open(os.path.join(args.out, "xla_tpu_peak.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
