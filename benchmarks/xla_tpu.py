"""Compile-time memory planning of the JAX LM's sharded train step, on host devices and TPU topologies.

    python benchmarks/xla_tpu.py            # 12 configurations per target: host, v5p:2x2x2
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
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # AOT only: no TPU to guard with libtpu's lockfile
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from torchnitro.xla.layout import pad_config  # noqa: E402
from torchnitro.xla.memory import plan_memory  # noqa: E402
from torchnitro.xla.model import LMConfig  # noqa: E402

MIB = 1024**2


def _grid(cfg: LMConfig, target: str, batches: list[int], seq: int) -> list[dict]:
    rows = []
    for mesh, rules in (("1x-1x1", "fsdp"), ("2x-1x2", "fsdp_tp")):
        for remat in ("none", "dots_saveable", "nothing_saveable"):
            for b in batches:
                t0 = time.perf_counter()
                p = plan_memory(cfg, b, seq, mesh=mesh, rules=rules, remat=remat, target=target)
                c, e = p.compiled, p.estimate
                rows.append(dict(target=target, mesh=p.mesh, rules=rules, remat=remat, batch=b, seq=seq,
                                 argument=c.argument, output=c.output, alias=c.alias, temp=c.temp, peak=c.peak,
                                 est_argument=e.argument, est_temp=e.grads + e.activations, est_peak=e.peak,
                                 est_error=p.estimate_error, hbm=p.hbm, flops=p.flops,
                                 compile_s=time.perf_counter() - t0))
                print(f"{target} {rules} {remat} B={b}: peak {c.peak / MIB:.1f} MiB, estimate "
                      f"{e.peak / MIB:.1f} MiB ({100 * p.estimate_error:+.0f}%)", file=sys.stderr)
    return rows


def _padding(cfg: LMConfig) -> dict:
    plain = plan_memory(cfg, 8, 64, mesh="1x-1x1", rules="fsdp", target="v5e:2x2")
    padded = plan_memory(pad_config(cfg, 128), 8, 64, mesh="1x-1x1", rules="fsdp", target="v5e:2x2")
    return dict(model=vars(cfg), logical_argument=plain.estimate.argument, tpu_argument=plain.compiled.argument,
                padded_logical_argument=padded.estimate.argument, padded_tpu_argument=padded.compiled.argument)


def _md(rows: list[dict], pad: dict, cfg: LMConfig) -> str:
    out = [f"# Compile-time memory per device, JAX LM {cfg.n_layers}x{cfg.dim} (vocab {cfg.vocab_size}), AdamW fp32",
           "", "| target | mesh | rules | remat | batch | args MiB | temp MiB | peak MiB | estimate MiB | error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mesh = "x".join(str(v) for v in r["mesh"].values())
        out.append(f"| {r['target']} | {mesh} | {r['rules']} | {r['remat']} | {r['batch']} | "
                   f"{r['argument'] / MIB:.2f} | {r['temp'] / MIB:.2f} | {r['peak'] / MIB:.2f} | "
                   f"{r['est_peak'] / MIB:.2f} | {100 * r['est_error']:+.0f}% |")
    out += ["", "Layout padding on v5e:2x2 (argument bytes per device, logical -> compiled for the TPU):", "",
            f"- unpadded: {pad['logical_argument']:,} -> {pad['tpu_argument']:,} "
            f"({pad['tpu_argument'] / pad['logical_argument']:.2f}x)",
            f"- padded to 128: {pad['padded_logical_argument']:,} -> {pad['padded_tpu_argument']:,} "
            f"({pad['padded_tpu_argument'] / pad['padded_logical_argument']:.2f}x)"]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, host and v5p only")
    ap.add_argument("--targets", default="host,v5p:2x2x2",
                    help="comma-separated; TPU compiles of the full model take 20-70 s each on a busy 2-core CPU")
    ap.add_argument("--out", default=os.environ.get("TORCHNITRO_RESULTS", "results"))
    args = ap.parse_args()
    if args.quick:
        cfg, targets, batches, seq = LMConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=128), \
            ["host", "v5p:2x2x2"], [8, 32], 128
    else:
        cfg, targets, batches, seq = LMConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, max_seq_len=512), \
            args.targets.split(","), [8, 32], 512
    rows = [r for t in targets for r in _grid(cfg, t, batches, seq)]
    pad = _padding(LMConfig(vocab_size=1000, dim=200, n_layers=2, n_heads=5, max_seq_len=64))
    os.makedirs(args.out, exist_ok=True)
    name = "xla_tpu_quick" if args.quick else "xla_tpu"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(model=vars(cfg), rows=rows, padding=pad), f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(_md(rows, pad, cfg))
    print(_md(rows, pad, cfg))


if __name__ == "__main__":
    main()
