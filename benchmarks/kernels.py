"""Fused-kernel benchmark (CUDA GPU): torchnitro Triton kernels vs PyTorch eager, torch.compile and Liger-Kernel.

    python benchmarks/kernels.py              # full sizes (H100-class GPU, ~10 min)
    python benchmarks/kernels.py --quick      # smaller shapes, no torch.compile
    python benchmarks/kernels.py --smoke      # CPU: run every case once on tiny shapes, no timing

Each op is timed forward, backward and forward+backward with ``triton.testing.do_bench`` (CUDA
events, L2 flushed between runs), and its peak extra memory for one forward+backward is recorded.
Memory-bound ops report GB/s and the share of this GPU's measured device-to-device copy bandwidth;
attention and GEMMs report TFLOP/s. Targets (from issue 3) are checked at the end. Writes
results/kernels_<gpu>.{json,md} and results/kernels_<gpu>.png.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

if "--smoke" in sys.argv:  # interpret every Triton kernel (ours and Liger's) on CPU; must precede the imports
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHNITRO_KERNELS", "triton")

import torch
import torch.nn.functional as F

from torchnitro import kernels as K
from torchnitro.bench import ResultTable, save_plot
from torchnitro.bench.provenance import provenance
from torchnitro.kernels import reference as R


@dataclass
class Case:
    op: str
    shape: str
    make: Callable[[], list]  # fresh inputs (leaf tensors with requires_grad where they need grads)
    providers: dict[str, Callable[..., torch.Tensor]]  # name -> fn(*inputs) -> output (or tuple)
    bytes_fwd: float = 0.0  # minimum HBM traffic of the forward (memory-bound ops)
    bytes_bwd: float = 0.0
    flops_fwd: float = 0.0  # for attention and GEMMs
    flops_bwd: float = 0.0
    backward: bool = True
    params: list = field(default_factory=list)  # extra leaves whose .grad is reset between runs (models)


def _liger(name: str) -> Callable | None:
    """A Liger-Kernel op by short name, or None when liger-kernel is not installed."""
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
        if name == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "geglu":
            from liger_kernel.ops.geglu import LigerGELUMulFunction  # tanh-approximate GELU

            return LigerGELUMulFunction.apply
        if name == "softmax":
            from liger_kernel.ops.softmax import LigerSoftmaxFunction

            return LigerSoftmaxFunction.apply
        if name == "rope":
            from liger_kernel.transformers import liger_rotary_pos_emb

            def rope(q, k, cos, sin):  # Liger takes HF tables (1, T, D) with duplicated halves
                c, s = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
                return liger_rotary_pos_emb(q, k, c, s)

            return rope
        if name == "cross_entropy":
            from liger_kernel.transformers import LigerCrossEntropyLoss

            return LigerCrossEntropyLoss()
        if name == "flce":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss()
            return lambda x, w, t: loss(w, x, t)
    except Exception:  # not installed, or an API change: the other providers still run
        return None
    return None


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def build_cases(dev: str, dt: torch.dtype, quick: bool, smoke: bool, use_compile: bool) -> list[Case]:
    s = 1 if smoke else (4 if quick else 1)
    tiny = smoke
    esz = torch.finfo(dt).bits // 8
    N, C = (8, 64) if tiny else (16384 // s, 4096)  # rows x hidden for norms
    Ng, Hg = (8, 96) if tiny else (16384 // s, 14336)  # rows x MLP hidden for GLU/GELU
    cases: list[Case] = []

    def t(*shape, grad=True, scale=1.0, dtype=dt):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_(grad)

    def add(op, shape, make, ours, ref, liger=None, **kw):
        prov = {"torchnitro": ours, "eager": ref}
        if use_compile:
            prov["compile"] = torch.compile(ref, dynamic=False)
        if liger is not None:
            prov["liger"] = liger
        cases.append(Case(op, shape, make, prov, **kw))

    add("rms_norm", f"({N}, {C})", lambda: [t(N, C), t(C)], lambda x, w: K.rms_norm(x, w, 1e-6),
        lambda x, w: R.rms_norm(x, w, 1e-6), _liger("rms_norm"), bytes_fwd=2 * N * C * esz, bytes_bwd=3 * N * C * esz)
    add("layer_norm", f"({N}, {C})", lambda: [t(N, C), t(C), t(C)], K.layer_norm, R.layer_norm,
        _liger("layer_norm"), bytes_fwd=2 * N * C * esz, bytes_bwd=3 * N * C * esz)
    add("gelu", f"({Ng}, {Hg})", lambda: [t(Ng, Hg)], K.gelu, R.gelu, None,
        bytes_fwd=2 * Ng * Hg * esz, bytes_bwd=3 * Ng * Hg * esz)
    add("swiglu", f"({Ng}, {Hg})", lambda: [t(Ng, Hg), t(Ng, Hg)], K.swiglu, R.swiglu, _liger("swiglu"),
        bytes_fwd=3 * Ng * Hg * esz, bytes_bwd=5 * Ng * Hg * esz)
    add("geglu_tanh", f"({Ng}, {Hg})", lambda: [t(Ng, Hg), t(Ng, Hg)], lambda g, u: K.geglu(g, u, "tanh"),
        lambda g, u: R.geglu(g, u, "tanh"), _liger("geglu"), bytes_fwd=3 * Ng * Hg * esz, bytes_bwd=5 * Ng * Hg * esz)
    Ns, Cs = (8, 40) if tiny else (32768 // s, 8192)
    add("softmax", f"({Ns}, {Cs})", lambda: [t(Ns, Cs, scale=3.0)], K.softmax, R.softmax, _liger("softmax"),
        bytes_fwd=2 * Ns * Cs * esz, bytes_bwd=3 * Ns * Cs * esz)
    B, H, Hk, T, D = (1, 2, 1, 16, 16) if tiny else (4 // s or 1, 32, 8, 4096, 128)
    cos, sin = (x.to(dev) for x in _rope_tables(T, D))
    add("rope(q,k)", f"q({B},{H},{T},{D}) k({B},{Hk},{T},{D})", lambda: [t(B, H, T, D), t(B, Hk, T, D)],
        lambda q, k: K.apply_rope(q, k, cos, sin), lambda q, k: (R.rope(q, cos, sin), R.rope(k, cos, sin)),
        (lambda q, k, f=_liger("rope"): f(q, k, cos, sin)) if _liger("rope") else None,
        bytes_fwd=2 * B * (H + Hk) * T * D * esz, bytes_bwd=2 * B * (H + Hk) * T * D * esz)
    Nv, V = (8, 100) if tiny else (8192 // s, 128256)
    tgt = torch.randint(0, V, (Nv,), device=dev)
    add("cross_entropy", f"({Nv}, {V})", lambda: [t(Nv, V)], lambda z: K.cross_entropy(z, tgt),
        lambda z: R.cross_entropy(z, tgt), (lambda z, f=_liger("cross_entropy"): f(z, tgt)) if _liger("cross_entropy")
        else None, bytes_fwd=Nv * V * esz, bytes_bwd=2 * Nv * V * esz)
    Nf, Df = (8, 32) if tiny else (8192 // s, 4096)
    tgt_f = torch.randint(0, V, (Nf,), device=dev)
    add("linear+cross_entropy", f"x({Nf}, {Df}) W({V}, {Df})", lambda: [t(Nf, Df), t(V, Df, scale=0.02)],
        lambda x, w: K.fused_linear_cross_entropy(x, w, tgt_f),
        lambda x, w: R.fused_linear_cross_entropy(x, w, tgt_f),
        (lambda x, w, f=_liger("flce"): f(x, w, tgt_f)) if _liger("flce") else None,
        flops_fwd=2 * Nf * Df * V, flops_bwd=4 * Nf * Df * V)
    M, Kd, Nn = (8, 32, 48) if tiny else (8192 // s, 4096, 16384)
    add("linear+bias+gelu", f"({M}, {Kd}) x ({Nn}, {Kd})", lambda: [t(M, Kd), t(Nn, Kd, scale=0.02), t(Nn)],
        K.linear_gelu, R.linear_gelu, None, flops_fwd=2 * M * Kd * Nn, flops_bwd=4 * M * Kd * Nn)
    Ba, Ha, Ta, Da = (1, 2, 32, 16) if tiny else (4 // s or 1, 16, 4096, 128)
    for causal in (False, True):
        fl = 4 * Ba * Ha * Ta * Ta * Da * (0.5 if causal else 1.0)
        prov = {"torchnitro": lambda q, k, v, c=causal: K.flash_attention(q, k, v, causal=c),
                "eager": lambda q, k, v, c=causal: R.flash_attention(q, k, v, causal=c)}
        if dev == "cuda":
            prov["sdpa_flash"] = lambda q, k, v, c=causal: _sdpa_flash(q, k, v, c)
        cases.append(Case(f"flash_attention{' causal' if causal else ''}", f"({Ba},{Ha},{Ta},{Da})",
                          lambda: [t(Ba, Ha, Ta, Da) for _ in range(3)], prov, flops_fwd=fl, flops_bwd=2.5 * fl))
    if not (tiny or quick):  # sequence-length sweep of causal attention against SDPA's flash backend
        for T2 in (1024, 2048, 8192):
            fl = 2 * Ba * Ha * T2 * T2 * Da
            prov = {"torchnitro": lambda q, k, v: K.flash_attention(q, k, v, causal=True),
                    "sdpa_flash": lambda q, k, v: _sdpa_flash(q, k, v, True)}
            cases.append(Case("flash_attention causal", f"({Ba},{Ha},{T2},{Da})",
                              lambda T2=T2: [t(Ba, Ha, T2, Da) for _ in range(3)], prov, flops_fwd=fl,
                              flops_bwd=2.5 * fl))
    cases.append(_lm_step_case(dev, dt, tiny, quick, use_compile))
    Nq, Cq = (8, 64) if tiny else (16384 // s, 8192)
    for per_row in (False, True):
        add(f"fp8_quantize({'row' if per_row else 'tensor'})", f"({Nq}, {Cq})", lambda: [t(Nq, Cq, grad=False)],
            lambda x, p=per_row: K.fp8_quantize(x, per_row=p)[0], lambda x, p=per_row: R.fp8_quantize(x, per_row=p)[0],
            None, bytes_fwd=Nq * Cq * (esz + 1), backward=False)
    return cases


def _lm_step_case(dev: str, dt: torch.dtype, tiny: bool, quick: bool, use_compile: bool) -> Case:
    """One training step (forward, loss, backward) of the reference TransformerLM: eager vs patch_."""
    from torchnitro.nn.models import TransformerConfig, TransformerLM

    if tiny:
        cfg, B, T = TransformerConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16), 1, 16
    else:
        d = 1024 if quick else 2048
        cfg = TransformerConfig(vocab_size=32000, dim=d, n_layers=4 if quick else 8, n_heads=d // 128,
                                n_kv_heads=d // 512, max_seq_len=2048)
        B, T = 4, 2048
    base = TransformerLM(cfg).to(dev, dt)
    models = {"eager": base}
    patched = TransformerLM(cfg).to(dev, dt)
    patched.load_state_dict(base.state_dict())
    K.patch_(patched)
    models["torchnitro"] = patched
    if use_compile:
        models["compile"] = torch.compile(base)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), device=dev)

    def step(m):
        return lambda tok: F.cross_entropy(m(tok)[:, :-1].reshape(-1, cfg.vocab_size).float(), tok[:, 1:].reshape(-1))

    n_params = sum(p.numel() for p in base.parameters())
    return Case("TransformerLM train step", f"d{cfg.dim} L{cfg.n_layers} B{B} T{T}", lambda: [tokens],
                {name: step(m) for name, m in models.items()}, flops_fwd=2 * n_params * B * T,
                flops_bwd=4 * n_params * B * T, params=list(base.parameters()) + list(patched.parameters()))


def _rope_tables(T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torchnitro.nn.models import rope_cache

    return rope_cache(T, D)


def _outputs(y) -> list[torch.Tensor]:
    return [o for o in (y if isinstance(y, (tuple, list)) else (y,)) if o.requires_grad]


def _fwd_bwd(fn, inputs, grads):
    outs = _outputs(fn(*inputs))
    torch.autograd.backward(outs, grads[: len(outs)])


def time_case(case: Case, name: str, fn: Callable, do_bench: Callable) -> dict:
    inputs = case.make()
    leaves = [x for x in inputs if x.requires_grad] + case.params
    y = fn(*inputs)
    row: dict = {"fwd_ms": do_bench(lambda: fn(*inputs))}
    if case.backward and leaves:
        outs = _outputs(y)
        grads = [torch.randn_like(o) for o in outs]
        row["bwd_ms"] = do_bench(lambda: torch.autograd.backward(outs, grads, retain_graph=True), grad_to_none=leaves)
        row["fwdbwd_ms"] = do_bench(lambda: _fwd_bwd(fn, inputs, grads), grad_to_none=leaves)
        del outs
    del y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if case.backward and leaves:
        out0 = _outputs(fn(*inputs))
        _fwd_bwd(fn, inputs, [torch.randn_like(o) for o in out0])
        del out0
    else:
        fn(*inputs)
    torch.cuda.synchronize()
    row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def copy_bandwidth(do_bench: Callable) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write) on a 1 GiB buffer."""
    src = torch.empty(2**28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def smoke(cases: list[Case]) -> int:
    """Run every provider once, forward and backward, on tiny CPU shapes (harness check, no timing)."""
    failed = 0
    for c in cases:
        for name, fn in c.providers.items():
            try:
                inputs = c.make()
                outs = _outputs(fn(*inputs))
                if c.backward and outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                print(f"ok    {c.op:28s} {name}", flush=True)
            except Exception as e:  # peers (Liger) may not run in the interpreter; ours must
                ours = name in ("torchnitro", "eager")
                failed += ours
                print(f"{'FAIL' if ours else 'skip'}  {c.op:28s} {name}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    return 1 if failed else 0


def run_cases(cases: list[Case], do_bench: Callable, bw: float, table: ResultTable) -> dict:
    """Time every provider of every case, derive GB/s, TFLOP/s and speedups, fill ``table``."""
    from rich.progress import track

    results: dict[tuple[str, str, str], dict] = {}
    for c in track(cases, description="kernels"):
        for name, fn in c.providers.items():
            try:
                results[(c.op, c.shape, name)] = r = time_case(c, name, fn, do_bench)
            except Exception as e:  # one failing provider (OOM, missing op) must not stop the run
                results[(c.op, c.shape, name)] = r = {"error": f"{type(e).__name__}: {e}"[:120]}
                torch.cuda.empty_cache()
            if "fwd_ms" in r:
                if c.bytes_fwd:
                    r["GB/s"] = c.bytes_fwd / (r["fwd_ms"] * 1e-3) / 1e9
                    r["%copy_bw"] = 100 * r["GB/s"] / bw
                if c.flops_fwd:
                    r["TFLOP/s"] = c.flops_fwd / (r["fwd_ms"] * 1e-3) / 1e12
        key = "fwdbwd_ms" if c.backward else "fwd_ms"
        for name in c.providers:
            r = results[(c.op, c.shape, name)]
            e, lg = results.get((c.op, c.shape, "eager"), {}), results.get((c.op, c.shape, "liger"), {})
            if key in r and key in e:
                r["x_eager"] = e[key] / r[key]
            if key in r and key in lg:
                r["x_liger"] = lg[key] / r[key]
            table.add(op=c.op, shape=c.shape, provider=name if "error" not in r else f"{name} ({r['error']})",
                      **{k: v for k, v in r.items() if k in table.columns})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, skip torch.compile")
    ap.add_argument("--smoke", action="store_true", help="CPU harness check on tiny shapes, no timing")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--ops", default="", help="comma-separated substrings of op names to run")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    args = ap.parse_args(argv)
    dt = getattr(torch, args.dtype)
    if args.smoke:
        return smoke([c for c in build_cases("cpu", torch.float32, True, True, False)
                      if not args.ops or any(o in c.op for o in args.ops.split(","))])
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (none is visible). On CPU the fused ops run their PyTorch "
              "references, so there is nothing to compare; run `python benchmarks/kernels.py --smoke` to check the "
              "harness instead.", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    gpu = torch.cuda.get_device_name()
    tag = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    bw = copy_bandwidth(do_bench)
    cases = [c for c in build_cases("cuda", dt, args.quick, False, not (args.quick or args.no_compile))
             if not args.ops or any(o in c.op for o in args.ops.split(","))]
    table = ResultTable(f"Fused kernels on {gpu} ({args.dtype})",
                        ["op", "shape", "provider", "fwd_ms", "bwd_ms", "fwdbwd_ms", "peak_mb", "GB/s", "%copy_bw",
                         "TFLOP/s", "x_eager", "x_liger"],
                        meta={**provenance("benchmarks/kernels.py", argv, device="cuda"), "gpu": gpu,
                              "copy_bw_GBps": round(bw, 1), "dtype": args.dtype, "timer": "triton.testing.do_bench"})
    results = run_cases(cases, do_bench, bw, table)
    table.print()
    targets = check_targets(cases, results)
    table.meta["targets"] = "; ".join(targets) or "none measured"
    table.save(f"kernels_{tag}")
    _plot(cases, results, f"kernels_{tag}", gpu)
    for t in targets:
        print(t)
    return 0


def check_targets(cases: list[Case], res: dict) -> list[str]:
    out = []
    mem_ops = {"rms_norm", "layer_norm", "gelu", "swiglu", "geglu_tanh", "softmax", "rope(q,k)", "cross_entropy"}
    for c in cases:
        ours = res.get((c.op, c.shape, "torchnitro"), {})
        if c.op in mem_ops and "%copy_bw" in ours:
            out.append(f"{c.op}: fwd {ours['%copy_bw']:.0f}% of copy bandwidth (target >= 80%): "
                       f"{'PASS' if ours['%copy_bw'] >= 80 else 'MISS'}")
        if "x_liger" in ours:
            out.append(f"{c.op}: {ours['x_liger']:.2f}x Liger fwd+bwd (target >= 1.0x): "
                       f"{'PASS' if ours['x_liger'] >= 1.0 else 'MISS'}")
        if c.op.startswith("flash_attention"):
            sd = res.get((c.op, c.shape, "sdpa_flash"), {})
            if "fwd_ms" in sd and "fwd_ms" in ours:
                ratio = sd["fwd_ms"] / ours["fwd_ms"]
                out.append(f"{c.op} {c.shape}: fwd {ratio:.2f}x SDPA flash (target >= 0.9x): "
                           f"{'PASS' if ratio >= 0.9 else 'MISS'}")
        if c.op == "linear+cross_entropy":
            e = res.get((c.op, c.shape, "eager"), {})
            if "peak_mb" in e and "peak_mb" in ours:
                ratio = ours["peak_mb"] / e["peak_mb"]
                out.append(f"fused linear+CE peak memory {ratio:.2f}x unfused at {c.shape} (target <= 0.3x): "
                           f"{'PASS' if ratio <= 0.3 else 'MISS'}")
    return out


def _plot(cases: list[Case], res: dict, name: str, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    provs = ["torchnitro", "compile", "liger", "sdpa_flash"]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.2
    for i, p in enumerate(provs):
        ys = [res.get((c.op, c.shape, p), {}).get("x_eager", math.nan) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    labels = [c.op if sum(d.op == c.op for d in cases) == 1 else f"{c.op} {c.shape}" for c in cases]
    ax.set_xticks([j + 1.5 * width for j in range(len(cases))], labels, rotation=40, ha="right")
    ax.set_ylabel("speedup vs eager (fwd+bwd)")
    ax.set_title(f"torchnitro fused kernels, {gpu}")
    ax.legend()
    save_plot(fig, name)


if __name__ == "__main__":
    sys.exit(main())
