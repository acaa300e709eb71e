"""Compile-time memory planning of the JAX LM's sharded train step, on host devices and TPU topologies.

    python benchmarks/xla_tpu.py            # v5p:2x2x2: 12 configurations + 2 with Pallas flash attention
    python benchmarks/xla_tpu.py --targets host,v5p:2x2x2,v4:2x2x2
    python benchmarks/xla_tpu.py --quick    # tiny model, host + v5p only

Nothing runs on a TPU: each step is lowered with ShapeDtypeStructs and compiled for 8 host CPU
devices, or through libtpu for a TPU topology described on this CPU. For every (mesh/rules, remat,
batch) it records XLA's per-device argument/output/alias/temp bytes and the analytic estimate, and
for one odd-sized model the argument bytes with and without layout padding on v5e (TPU layouts
tile the two minor dims). Step time, MFU and overlap need a TPU and are not measured here.
Writes results/xla_tpu.{json,md} (results/xla_tpu_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # AOT only: no TPU to guard with libtpu's lockfile
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
_DUMP: str | None = None  # --buffers DIR: every compile's XLA dump is kept in DIR/<row name>

from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.xla.layout import pad_config  # noqa: E402
from torchnitro.xla.memory import plan_memory  # noqa: E402
from torchnitro.xla.model import LMConfig  # noqa: E402

MIB = 1024**2


def _row(cfg: LMConfig, target: str, mesh: str, rules: str, remat: str, b: int, seq: int) -> dict:
    dump = os.path.join(_DUMP, f"{target.replace(':', '_')}_{rules}_{remat}_{cfg.attention}_b{b}") if _DUMP else None
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    t0 = time.perf_counter()
    p = plan_memory(cfg, b, seq, mesh=mesh, rules=rules, remat=remat, target=target, dump_dir=dump)
    c, e = p.compiled, p.estimate
    row = dict(target=target, mesh=p.mesh, rules=rules, remat=remat, attention=cfg.attention, batch=b, seq=seq,
               argument=c.argument, output=c.output, alias=c.alias, temp=c.temp, peak=c.peak,
               est_argument=e.argument, est_at_peak=e.at_peak, est_temp=e.temp, est_peak=e.peak,
               est_error=p.estimate_error, hbm=p.hbm,
               flops=p.flops, compile_s=time.perf_counter() - t0)
    if dump:
        row |= _reread(dict(xla_dump=dump)) | dict(xla_dump=dump)
    print(f"{target} {rules} {remat} {cfg.attention} B={b}: peak {c.peak / MIB:.1f} MiB, estimate "
          f"{e.peak / MIB:.1f} MiB ({100 * p.estimate_error:+.0f}%)", file=sys.stderr, flush=True)
    return row


def _xla_numbers(d) -> dict:  # a torchnitro.xla.dump.BufferDump as row fields (color 0: HBM, 1: VMEM)
    return dict(xla_hbm_temp=d.temp_by_color.get(0, 0), xla_vmem_temp=d.temp_by_color.get(1, 0),
                xla_live_hbm=d.live_peak_by_color.get(0, 0), xla_live_vmem=d.live_peak_by_color.get(1, 0),
                xla_values_peak_hbm=d.values_peak_by_color.get(0, 0))


def _grid(cfg: LMConfig, target: str, batches: list[int], seq: int,
          rule_sets: tuple[str, ...] = ("fsdp", "fsdp_tp")) -> list[dict]:
    rows = [_row(cfg, target, mesh, rules, remat, b, seq)
            for mesh, rules in (("1x-1x1", "fsdp"), ("2x-1x2", "fsdp_tp")) if rules in rule_sets
            for remat in ("none", "dots_saveable", "nothing_saveable") for b in batches]
    if target != "host" and "fsdp" in rule_sets:  # the Pallas kernel compiled for the TPU (Mosaic)
        flash = dataclasses.replace(cfg, attention="flash")
        rows += [_row(flash, target, "1x-1x1", "fsdp", "nothing_saveable", b, seq) for b in batches]
    return rows


def _padding(cfg: LMConfig) -> dict:
    plain = plan_memory(cfg, 8, 64, mesh="1x-1x1", rules="fsdp", target="v5e:2x2")
    padded = plan_memory(pad_config(cfg, 128), 8, 64, mesh="1x-1x1", rules="fsdp", target="v5e:2x2")
    return dict(model=dataclasses.asdict(cfg), logical_argument=_logical_args(cfg),
                tpu_argument=plain.compiled.argument,
                padded_logical_argument=_logical_args(pad_config(cfg, 128)),
                padded_tpu_argument=padded.compiled.argument, tiled_estimate=plain.estimate.argument,
                padded_tiled_estimate=padded.estimate.argument)


def _kinds(k: dict) -> str:
    return "; ".join(f"{k.get(n, 0) / MIB:.1f}" for n in ("weights", "dots", "other", "grads"))


def _ordering(rows: list[dict], target: str) -> str:
    """Whether compiled temp orders none > dots_saveable > nothing_saveable, per (rules, batch), plain attention."""
    out = []
    for rules in dict.fromkeys(r["rules"] for r in rows):
        for b in sorted({r["batch"] for r in rows}):
            t = {r["remat"]: r["temp"] for r in rows if r["target"] == target and r["rules"] == rules
                 and r["batch"] == b and r["attention"] == "plain"}
            if len(t) == 3:
                ok = t["none"] > t["dots_saveable"] > t["nothing_saveable"]
                out.append(f"{rules} B={b}: {t['none'] / MIB:.0f} / {t['dots_saveable'] / MIB:.0f} / "
                           f"{t['nothing_saveable'] / MIB:.0f} MiB {'holds' if ok else 'does not hold'}")
    return f"Remat ordering none > dots_saveable > nothing_saveable in compiled temp on {target}: " + "; ".join(out)


def _ordered(t: dict) -> str:
    ok = t["none"] > t["dots_saveable"] > t["nothing_saveable"]
    return f"{t['none'] / MIB:.1f} / {t['dots_saveable'] / MIB:.1f} / {t['nothing_saveable'] / MIB:.1f} " + \
        ("holds" if ok else "does not hold")


def _buffers_md(rows: list[dict]) -> list[str]:
    """The walk against memory_analysis temp and against XLA's own buffer assignment (rows made with --buffers)."""
    rows = [r for r in rows if "xla_hbm_temp" in r]
    if not rows:
        return []
    pct = lambda a, b: f"{100 * (a / b - 1):+.0f}%" if b else "n/a"  # noqa: E731
    out = ["", "XLA's own buffer assignment (`--buffers`, `torchnitro.xla.dump`), MiB per device: memory_analysis "
           "temp; the HBM (color 0) and VMEM (color 1) preallocated-temp allocations; HBM temp values live at XLA's "
           "peak step; the peak over the schedule of HBM temp values' live bytes (no packing); the walk "
           "(`est_temp`) and its error against each.", "",
           "| target | rules | remat | attention | batch | memory_analysis temp | HBM alloc | VMEM alloc | "
           "HBM live at XLA peak | HBM values peak | walk | vs temp | vs HBM alloc | vs HBM values peak | "
           "temp - HBM alloc |", "| --- " * 15 + "|"]
    for r in rows:
        out.append(f"| {r['target']} | {r['rules']} | {r['remat']} | {r['attention']} | {r['batch']} | "
                   f"{r['temp'] / MIB:.2f} | {r['xla_hbm_temp'] / MIB:.2f} | {r['xla_vmem_temp'] / MIB:.2f} | "
                   f"{r['xla_live_hbm'] / MIB:.2f} | {r['xla_values_peak_hbm'] / MIB:.2f} | {r['est_temp'] / MIB:.2f} | "
                   f"{pct(r['est_temp'], r['temp'])} | {pct(r['est_temp'], r['xla_hbm_temp'])} | "
                   f"{pct(r['est_temp'], r['xla_values_peak_hbm'])} | {(r['temp'] - r['xla_hbm_temp']) / MIB:+.2f} |")
    for target in dict.fromkeys(r["target"] for r in rows):
        tr = [r for r in rows if r["target"] == target]
        within = lambda a, b: sum(abs(r[a] / r[b] - 1) <= 0.10 for r in tr if r[b])  # noqa: E731
        out.append(f"\n{target}, {len(tr)} rows within 10%: walk vs memory_analysis temp {within('est_temp', 'temp')}; "
                   f"walk vs XLA's HBM temp allocation {within('est_temp', 'xla_hbm_temp')}; walk vs XLA's HBM "
                   f"values peak {within('est_temp', 'xla_values_peak_hbm')}; XLA's own HBM temp allocation vs "
                   f"memory_analysis temp {within('xla_hbm_temp', 'temp')} (the ceiling of any model of HBM "
                   "buffers that memory_analysis is scored against).")
        for key, what in (("temp", "memory_analysis temp"), ("xla_hbm_temp", "XLA's HBM temp allocation"),
                          ("xla_values_peak_hbm", "XLA's HBM values peak"), ("est_temp", "the walk")):
            cells = []
            for rules in dict.fromkeys(r["rules"] for r in tr):
                for b in sorted({r["batch"] for r in tr}):
                    t = {r["remat"]: r[key] for r in tr if r["rules"] == rules and r["batch"] == b
                         and r["attention"] == "plain"}
                    if len(t) == 3:
                        cells.append(f"{rules} B={b}: {_ordered(t)}")
            if cells:
                out.append(f"Remat ordering none > dots_saveable > nothing_saveable in {what}: " + "; ".join(cells))
    return out


def _logical_args(cfg: LMConfig) -> int:
    """Per-device argument bytes as logical shards (4 devices of v5e:2x2, FSDP), batch 8 x 64."""
    import jax
    import optax

    from torchnitro.xla.lm import batch_spec
    from torchnitro.xla.model import param_spec

    p = param_spec(cfg)
    leaves = jax.tree.leaves((p, jax.eval_shape(optax.adamw(1e-3).init, p), batch_spec(8, 64)))
    return sum(x.size * x.dtype.itemsize for x in leaves) // 4


def _md(rows: list[dict], pad: dict, cfg: LMConfig) -> str:
    out = [f"# Compile-time memory per device, JAX LM {cfg.n_layers}x{cfg.dim} (vocab {cfg.vocab_size}, "
           f"{cfg.n_heads} heads), AdamW fp32", "",
           "Compiled: XLA's `memory_analysis()` (peak = arguments + outputs - aliased + temp). Estimate: "
           "`torchnitro.xla.estimate` (arguments in TPU tiles; temp = the peak of the liveness walk over one "
           "device's loss-and-gradient jaxpr, `torchnitro.xla.liveness`; in brackets what is live at that peak, "
           "MiB: w = FSDP-gathered weights, d = matmul outputs, o = other materialised values, g = gradient "
           "shards).", "",
           "| target | mesh | rules | remat | attention | batch | args MiB | est args | temp MiB | est temp "
           "(w; d; o; g) | peak MiB | estimate MiB | error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mesh = "x".join(str(v) for v in r["mesh"].values())
        out.append(f"| {r['target']} | {mesh} | {r['rules']} | {r['remat']} | {r['attention']} | {r['batch']} | "
                   f"{r['argument'] / MIB:.2f} | {r['est_argument'] / MIB:.2f} | {r['temp'] / MIB:.2f} | "
                   f"{r['est_temp'] / MIB:.2f} ({_kinds(r['est_at_peak'])}) | {r['peak'] / MIB:.2f} | "
                   f"{r['est_peak'] / MIB:.2f} | "
                   f"{100 * r['est_error']:+.0f}% |")
    for target in dict.fromkeys(r["target"] for r in rows):
        errs = [abs(r["est_error"]) for r in rows if r["target"] == target]
        out.append(f"\n{target}: {sum(e <= 0.10 for e in errs)} of {len(errs)} configurations within 10% "
                   f"(max |error| {100 * max(errs):.0f}%); misses: "
                   + (", ".join(f"{r['rules']}/{r['remat']}/{r['attention']}/B={r['batch']} "
                                f"{100 * r['est_error']:+.0f}%" for r in rows
                                if r["target"] == target and abs(r["est_error"]) > 0.10) or "none"))
        out.append(_ordering(rows, target))
    out += _buffers_md(rows)
    out += ["", "Layout padding on v5e:2x2 (argument bytes per device, logical -> compiled for the TPU):", "",
            f"- unpadded: {pad['logical_argument']:,} -> {pad['tpu_argument']:,} "
            f"({pad['tpu_argument'] / pad['logical_argument']:.2f}x)",
            f"- padded to 128: {pad['padded_logical_argument']:,} -> {pad['padded_tpu_argument']:,} "
            f"({pad['padded_tpu_argument'] / pad['padded_logical_argument']:.2f}x)"]
    return "\n".join(out) + "\n"


# --model name -> (config, sequence length); "small" is the width-256 LM whose v5p buffer assignments fixed the
# estimate's buffer counts (torchnitro/xla/estimate.py), "lm" the 4x512 LM it was not fitted on
MODELS = {"lm": (LMConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, max_seq_len=512), 512),
          "small": (LMConfig(vocab_size=8192, dim=256, n_layers=2, n_heads=4, max_seq_len=256), 256)}


def _reread(row: dict) -> dict:
    """A --buffers row's XLA numbers read again from its kept dump (when the dump is still there)."""
    from torchnitro.xla.dump import read_buffer_dump

    if not row.get("xla_dump") or not os.path.isdir(row["xla_dump"]):
        return {}
    try:
        return _xla_numbers(read_buffer_dump(row["xla_dump"]))
    except Exception as exc:  # a dump that is missing or unreadable is recorded, never fatal to the grid
        return dict(xla_dump_error=f"{type(exc).__name__}: {exc}"[:300])


def _reestimate(path: str) -> tuple[dict, list[dict]]:
    """Rows of an earlier run with the estimate recomputed by the current model (no compile: milliseconds)."""
    import optax

    from torchnitro.xla.estimate import estimate_memory
    from torchnitro.xla.lm import lm_train_step
    from torchnitro.xla.mesh import make_mesh

    data = json.load(open(path))
    base = LMConfig(**data["model"])
    rows = []
    for r in data["rows"]:
        cfg = dataclasses.replace(base, attention=r.get("attention", "plain"))
        mesh = make_mesh("x".join(str(v) for v in r["mesh"].values()),
                         target=None if r["target"] == "host" else r["target"])
        step = lm_train_step(cfg, optax.adamw(1e-3), mesh, r["rules"], r["batch"], r["seq"], remat=r["remat"])
        e = estimate_memory(cfg, step, r["batch"], r["seq"], r["remat"])
        rows.append({k: v for k, v in r.items() if not k.startswith("est_")}
                    | {"attention": cfg.attention, "est_argument": e.argument, "est_at_peak": e.at_peak,
                       "est_temp": e.temp, "est_peak": e.peak, "est_error": e.peak / r["peak"] - 1}
                    | _reread(r))
    return data, rows


# the seed's claim: 14 / 22 / 38 GB per device at global batch 8 / 16 / 32 on 8 TPU cores, model unstated.
# The estimate (no compile) over GPT-like sizes (vocab 32000, FSDP over 8, no remat) puts a 2.9B model
# (width 2560, 36 layers, seq 1024) at 13.4 / 21.8 / 38.4 GB; that model is compiled here.
SEED_CLAIM_GB = {8: 14.0, 16: 22.0, 32: 38.0}
SEED_MODEL = (LMConfig(vocab_size=32000, dim=2560, n_layers=36, n_heads=20, max_seq_len=1024), 1024)


def _seed(targets: list[str], out: str) -> list[dict]:
    """Compile the seed model at each claimed batch; the results files are rewritten after every compile."""
    cfg, seq = SEED_MODEL
    rows: list[dict] = []
    for t in targets:
        for b, claim in SEED_CLAIM_GB.items():
            t0 = time.perf_counter()
            try:
                p = plan_memory(cfg, b, seq, mesh="1x-1x1", rules="fsdp", remat="none", target=t)
            except Exception as exc:  # the TPU compiler refuses a program over the device's HBM (RESOURCE_EXHAUSTED)
                rows.append(dict(target=t, batch=b, claim_gb=claim, error=f"{type(exc).__name__}: {exc}"[:600],
                                 compile_s=time.perf_counter() - t0))
                print(f"seed {t} B={b}: compile failed ({type(exc).__name__})", file=sys.stderr, flush=True)
                _write_seed(rows, out)
                continue
            rows.append(dict(target=t, batch=b, claim_gb=claim, peak=p.compiled.peak, temp=p.compiled.temp,
                             argument=p.compiled.argument, est_peak=p.estimate.peak, hbm=p.hbm,
                             compile_s=time.perf_counter() - t0))
            print(f"seed {t} B={b}: {p.compiled.peak / 1e9:.1f} GB (claim {claim})", file=sys.stderr, flush=True)
            _write_seed(rows, out)
    return rows


def _with_header(md: str) -> str:
    """``md`` with the provenance lines (command, machine, versions, commit, time, load) under its title."""
    title, rest = md.split("\n", 1)
    head = provenance("benchmarks/xla_tpu.py", packages=("jax", "jaxlib", "libtpu", "optax", "orbax-checkpoint"))
    return title + "\n\n" + "".join(f"- {k}: {v}\n" for k, v in head.items()) + rest


def _write_seed(rows: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "xla_tpu_seed.json"), "w") as f:
        json.dump(dict(model=dataclasses.asdict(SEED_MODEL[0]), seq=SEED_MODEL[1], rows=rows), f, indent=1)
    with open(os.path.join(out, "xla_tpu_seed.md"), "w") as f:
        f.write(_with_header(_seed_md(rows)))


def _seed_md(rows: list[dict]) -> str:
    cfg, seq = SEED_MODEL
    n = sum(math.prod(x.shape) for x in jax_leaves_params(cfg))
    out = [f"# The seed's 14/22/38 GB claim (batch 8/16/32 on 8 TPU cores)", "",
           f"Model assumed: JAX LM {cfg.n_layers}x{cfg.dim} ({cfg.n_heads} heads, vocab {cfg.vocab_size}, "
           f"{n / 1e9:.2f}B parameters), seq {seq}, AdamW fp32, FSDP over the 8 devices, no remat. Chosen as the "
           "size whose analytic estimate matches the claim (see SEED_MODEL in benchmarks/xla_tpu.py); the claim "
           "names no model, so a match says a model of this size is consistent with it, not that it was this one.",
           "", "| target | batch | claim GB | compiled peak GB | estimate GB | HBM per device GB | fits |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['target']} | {r['batch']} | {r['claim_gb']:.0f} | compile failed | | | no |")
            continue
        out.append(f"| {r['target']} | {r['batch']} | {r['claim_gb']:.0f} | {r['peak'] / 1e9:.1f} | "
                   f"{r['est_peak'] / 1e9:.1f} | {r['hbm'] / 1e9:.1f} | {r['peak'] <= r['hbm']} |")
    out += [""] + [f"- {r['target']} batch {r['batch']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join(out) + "\n"


def jax_leaves_params(cfg: LMConfig) -> list:
    import jax

    from torchnitro.xla.model import param_spec

    return jax.tree.leaves(param_spec(cfg))


def _throughput(steps: int = 10) -> dict:
    """Step throughput of the small LM on 8 host devices (FSDP) vs 1 device, same global batch (CPU only)."""
    import jax
    import optax

    from torchnitro.xla.lm import lm_train_step, random_batch
    from torchnitro.xla.mesh import make_mesh
    from torchnitro.xla.model import init_params

    cfg, seq = MODELS["small"]
    b = 8
    out = dict(model=dataclasses.asdict(cfg), batch=b, seq=seq, steps=steps, cpu_count=os.cpu_count(),
               load_before=os.getloadavg()[0], rows=[])
    for name, mesh in (("1 device", make_mesh("1x1x1", devices=jax.devices()[:1])), ("8 host devices, fsdp 1x8x1",
                                                                                      make_mesh("1x8x1"))):
        step = lm_train_step(cfg, optax.adamw(1e-3), mesh, "fsdp", b, seq)
        params, opt = step.init(init_params(cfg))
        batch = step.place_batch(random_batch(cfg, b, seq))
        params, opt, loss = step(params, opt, batch)  # compile + first step, untimed
        loss.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(steps):
            params, opt, loss = step(params, opt, batch)
        loss.block_until_ready()
        dt = (time.perf_counter() - t0) / steps
        out["rows"].append(dict(mesh=name, step_s=dt, tokens_per_s=b * seq / dt, loss=float(loss)))
        print(f"throughput {name}: {dt * 1e3:.0f} ms/step", file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()[0]
    return out


def _throughput_md(t: dict) -> str:
    base = t["rows"][0]["step_s"]
    out = [f"# Step throughput on host CPU devices: 8 vs 1 (JAX LM {t['model']['n_layers']}x{t['model']['dim']}, "
           f"global batch {t['batch']} x {t['seq']} tokens, {t['steps']} timed steps)", "",
           "| mesh | ms / step | tokens / s | vs 1 device |", "| --- | --- | --- | --- |"]
    for r in t["rows"]:
        out.append(f"| {r['mesh']} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {base / r['step_s']:.2f}x |")
    out += ["", f"Machine: {t['cpu_count']} CPU cores, load average {t['load_before']:.1f} before and "
            f"{t['load_after']:.1f} after (other jobs were running). The 8 'devices' are XLA host devices "
            "(`--xla_force_host_platform_device_count=8`) sharing these cores: the ratio measures the cost of "
            "SPMD partitioning and in-process collectives on a CPU, not scaling. It says nothing about a TPU, "
            "where step time, MFU and compute/communication overlap are not measured."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, host and v5p only")
    ap.add_argument("--model", choices=sorted(MODELS), default="lm", help="LM size for the grid")
    ap.add_argument("--targets", default="v5p:2x2x2",
                    help="comma-separated; TPU compiles of the full model take 20-70 s each on a busy 2-core CPU")
    ap.add_argument("--seed-claim", action="store_true",
                    help="compile the seed's 14/22/38 GB configuration only (use --targets v5p:2x2x2,v4:2x2x1)")
    ap.add_argument("--throughput", action="store_true", help="8 host devices vs 1 device step time only")
    ap.add_argument("--reestimate", metavar="JSON", help="recompute the estimates of an earlier run's rows only")
    ap.add_argument("--rules", default="fsdp,fsdp_tp", help="rule sets of the grid (fsdp 1x8x1, fsdp_tp 2x2x2); "
                    "flash rows come with fsdp")
    ap.add_argument("--buffers", metavar="DIR", help="also dump XLA's buffer assignment of every compile into DIR "
                    "and record its HBM/VMEM temp allocations and live peaks beside memory_analysis")
    ap.add_argument("--out", default=os.environ.get("TORCHNITRO_RESULTS", "results"))
    args = ap.parse_args()
    global _DUMP
    _DUMP = args.buffers
    if args.throughput:
        t = _throughput()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "xla_throughput_cpu.json"), "w") as f:
            json.dump(t, f, indent=1)
        md = _with_header(_throughput_md(t))
        with open(os.path.join(args.out, "xla_throughput_cpu.md"), "w") as f:
            f.write(md)
        print(md)
        return
    if args.seed_claim:  # v5p:2x2x2 is 8 chips, one device each; v4:2x2x1 is 4 chips, two cores (devices) each
        _seed(args.targets.split(","), args.out)
        return
    name = "xla_tpu_quick" if args.quick else "xla_tpu" if args.model == "lm" else f"xla_tpu_{args.model}"
    if args.reestimate:
        data, rows = _reestimate(args.reestimate)
        cfg, pad = LMConfig(**data["model"]), data["padding"]
        name = os.path.splitext(os.path.basename(args.reestimate))[0]
    else:
        if args.quick:
            cfg, targets, batches, seq = LMConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=128), \
                ["host", "v5p:2x2x2"], [8, 32], 128
        else:
            (cfg, seq), targets, batches = MODELS[args.model], args.targets.split(","), [8, 32]
        rule_sets = tuple(args.rules.split(","))
        rows = [r for t in targets for r in _grid(cfg, t, batches, seq, rule_sets)]
        name += ("_" + "_".join(t.replace(":", "_") for t in targets) if targets != ["v5p:2x2x2"] and not args.quick
                 else "") + ("_" + "_".join(rule_sets) if rule_sets != ("fsdp", "fsdp_tp") else "") + \
            ("_buffers" if args.buffers else "")
        pad = _padding(LMConfig(vocab_size=1000, dim=200, n_layers=2, n_heads=5, max_seq_len=64))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(model=dataclasses.asdict(cfg), rows=rows, padding=pad), f, indent=1)
    md = _with_header(_md(rows, pad, cfg))
    if args.reestimate:
        md += (f"\nCompiled columns from an earlier run ({os.path.basename(args.reestimate)}); the estimate columns "
               "recomputed by the current model with `--reestimate`.\n")
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
