"""Fused-kernel benchmark (CUDA GPU): torchnitro kernels vs eager, torch.compile, every SDPA backend,
Liger-Kernel and torchao, all in one run with one timer.

    python benchmarks/kernels.py              # the issue-21 shapes, then the larger ones (H100-class GPU)
    python benchmarks/kernels.py --issue21    # the FP8 block and the issue-21 shapes only
    python benchmarks/kernels.py --sweep      # also the causal attention length sweep
    python benchmarks/kernels.py --quick      # the issue-21 shapes (other ops at 1/4), no torch.compile provider
    python benchmarks/kernels.py --ops flash,fp8_train,layer_norm   # a subset (substrings of op names)
    python benchmarks/kernels.py --tuned      # also print the launch configs the kernels picked
    python benchmarks/kernels.py --smoke      # CPU: run every case once on tiny shapes, no timing

Each op is timed forward, backward and forward+backward with ``triton.testing.do_bench`` (CUDA
events, L2 flushed between runs), and its peak extra memory for one forward+backward is recorded.
Memory-bound ops report GB/s and the share of this GPU's measured device-to-device copy bandwidth;
attention and GEMMs report TFLOP/s. Attention is timed against each SDPA backend separately (cuDNN,
flash, memory-efficient; one this GPU lacks records its reason) plus "sdpa_best", the fastest per
phase. The FP8 row is a compiled Llama-3-8B block train step: bf16 vs ours vs torchao float8.
A provider that fails writes its error into its row; the others still run. The issue-21 targets
are checked at the end, per shape.

Shapes (``--sizes``): first the issue-21 rows (norms (4096, 4096); RoPE q(1,32,4096,128)
k(1,8,4096,128); attention (1,16,4096,128) plain and causal; linear+CE x(2048, 4096) W(128256, 4096);
linear+bias+GELU (2048, 4096) x (16384, 4096)), then the same ops at the larger shapes of earlier
runs (norms 16384 rows, RoPE and attention batch 4, linear+CE and GELU 8192 rows), then the other
ops; ``--sweep`` adds the causal attention length sweep last (kept out of the default to bound the
run: the issue-21 rows add roughly a third to the earlier ~185 s of the suite's op subset, an estimate).

``host_ms`` is the host's time to enqueue one call (fwd+bwd, or fwd for forward-only rows) on an
idle GPU, median of a few: when it approaches the device time, Python, not the GPU, limits the op
(benchmarks/host_overhead.py breaks it down without a GPU).

Output: results/kernels_<gpu>[_<tag>].{json,md,png} (``--tag``). Earlier results are never
overwritten: if that name is taken, the UTC date and time are appended
(kernels_nvidia_h200_20261126T1310). The table is re-saved after every case, so a run cut off by
a time limit still leaves the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import (Case, attention_cases, best_name, fold_best, first_call_s, fp8_train_case,  # noqa: E402
                          linear_gelu_variants, tuned_configs)


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


ISSUE21 = {  # the issue-21 shapes (rows x hidden, RoPE batch, attention batch, linear+CE rows, GELU rows)
    "norm_rows": 4096, "rope_batch": 1, "attn_batch": 1, "flce_rows": 2048, "gelu_rows": 2048,
}
LARGE = {"norm_rows": 16384, "rope_batch": 4, "attn_batch": 4, "flce_rows": 8192, "gelu_rows": 8192}


def build_cases(dev: str, dt: torch.dtype, quick: bool, smoke: bool, use_compile: bool,
                sizes: str = "all", sweep: bool = False) -> list[Case]:
    """Every case; ``sizes``: "all" (the issue-21 shapes, then the larger ones), "issue21" (the FP8 block
    and the issue-21 shapes only) or "large" (the larger shapes only). ``sweep`` adds the causal
    attention length sweep (T = 1024, 2048, 8192 at batch 4) at the end."""
    s = 1 if smoke else (4 if quick else 1)
    tiny = smoke
    # the compiled FP8 block first: its compiles are the slowest part, and a run cut off by a time limit
    # keeps the rows it finished (the table is re-saved after every case); the issue-21 rows next
    cases: list[Case] = [fp8_train_case(dev, dt, tiny, compile_models=not smoke)]
    cases[0].issue21 = True

    def t(*shape, grad=True, scale=1.0, dtype=dt):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_(grad)

    def add(op, shape, make, ours, ref, liger=None, **kw) -> Case:
        prov = {"torchnitro": ours, "eager": ref}
        if use_compile:
            prov["compile"] = torch.compile(ref, dynamic=False)
        if liger is not None:
            prov["liger"] = liger
        cases.append(Case(op, shape, make, prov, **kw))
        return cases[-1]

    sets = {"all": (ISSUE21, LARGE), "issue21": (ISSUE21,), "large": (LARGE,)}[sizes]
    if quick or smoke:  # the quick shapes are the issue-21 ones; tiny shapes once
        sets = (ISSUE21,)
    for size in sets:
        first = len(cases)
        _target_cases(add, t, dev, dt, tiny, size)
        cases += attention_cases(dev, t, tiny, K.flash_attention, R.flash_attention, batch=size["attn_batch"])
        for c in cases[first:]:
            c.issue21 = size is ISSUE21
    if sizes == "issue21":
        return cases
    _other_cases(add, t, dev, dt, tiny, s)
    cases.append(_lm_step_case(dev, dt, tiny, quick, use_compile))
    if sweep and not (tiny or quick):  # last: the causal length sweep at the larger batch
        cases += attention_cases(dev, t, tiny, K.flash_attention, R.flash_attention, batch=LARGE["attn_batch"],
                                 shapes=[(True, T2) for T2 in (1024, 2048, 8192)])
    return cases


def _target_cases(add: Callable, t: Callable, dev: str, dt: torch.dtype, tiny: bool, size: dict) -> None:
    """The ops with issue-21 targets at one size set: norms, RoPE, linear+CE, linear+bias+GELU."""
    esz = torch.finfo(dt).bits // 8
    N, C = (8, 64) if tiny else (size["norm_rows"], 4096)  # rows x hidden for norms
    add("rms_norm", f"({N}, {C})", lambda: [t(N, C), t(C)], lambda x, w: K.rms_norm(x, w, 1e-6),
        lambda x, w: R.rms_norm(x, w, 1e-6), _liger("rms_norm"), bytes_fwd=2 * N * C * esz, bytes_bwd=3 * N * C * esz)
    add("layer_norm", f"({N}, {C})", lambda: [t(N, C), t(C), t(C)], K.layer_norm, R.layer_norm,
        _liger("layer_norm"), bytes_fwd=2 * N * C * esz, bytes_bwd=3 * N * C * esz)
    B, H, Hk, T, D = (1, 2, 1, 16, 16) if tiny else (size["rope_batch"], 32, 8, 4096, 128)
    cos, sin = (x.to(dev) for x in _rope_tables(T, D))
    add("rope(q,k)", f"q({B},{H},{T},{D}) k({B},{Hk},{T},{D})", lambda: [t(B, H, T, D), t(B, Hk, T, D)],
        lambda q, k: K.apply_rope(q, k, cos, sin), lambda q, k: (R.rope(q, cos, sin), R.rope(k, cos, sin)),
        (lambda q, k, f=_liger("rope"): f(q, k, cos, sin)) if _liger("rope") else None,
        bytes_fwd=2 * B * (H + Hk) * T * D * esz, bytes_bwd=2 * B * (H + Hk) * T * D * esz)
    V = 100 if tiny else 128256
    Nf, Df = (8, 32) if tiny else (size["flce_rows"], 4096)
    tgt_f = torch.randint(0, V, (Nf,), device=dev)
    add("linear+cross_entropy", f"x({Nf}, {Df}) W({V}, {Df})", lambda: [t(Nf, Df), t(V, Df, scale=0.02)],
        lambda x, w: K.fused_linear_cross_entropy(x, w, tgt_f),
        lambda x, w: R.fused_linear_cross_entropy(x, w, tgt_f),
        (lambda x, w, f=_liger("flce"): f(x, w, tgt_f)) if _liger("flce") else None,
        flops_fwd=2 * Nf * Df * V, flops_bwd=4 * Nf * Df * V)
    M, Kd, Nn = (8, 32, 48) if tiny else (size["gelu_rows"], 4096, 16384)
    gelu = add("linear+bias+gelu", f"({M}, {Kd}) x ({Nn}, {Kd})", lambda: [t(M, Kd), t(Nn, Kd, scale=0.02), t(Nn)],
               K.linear_gelu, R.linear_gelu, None, flops_fwd=2 * M * Kd * Nn, flops_bwd=4 * M * Kd * Nn)
    gelu.providers.update(linear_gelu_variants())  # e.g. a cuBLASLt-epilogue variant, when exported


def _other_cases(add: Callable, t: Callable, dev: str, dt: torch.dtype, tiny: bool, s: int) -> None:
    """Fused ops without an issue-21 target, at one size."""
    esz = torch.finfo(dt).bits // 8
    Ng, Hg = (8, 96) if tiny else (16384 // s, 14336)  # rows x MLP hidden for GLU/GELU
    add("gelu", f"({Ng}, {Hg})", lambda: [t(Ng, Hg)], K.gelu, R.gelu, None,
        bytes_fwd=2 * Ng * Hg * esz, bytes_bwd=3 * Ng * Hg * esz)
    add("swiglu", f"({Ng}, {Hg})", lambda: [t(Ng, Hg), t(Ng, Hg)], K.swiglu, R.swiglu, _liger("swiglu"),
        bytes_fwd=3 * Ng * Hg * esz, bytes_bwd=5 * Ng * Hg * esz)
    add("geglu_tanh", f"({Ng}, {Hg})", lambda: [t(Ng, Hg), t(Ng, Hg)], lambda g, u: K.geglu(g, u, "tanh"),
        lambda g, u: R.geglu(g, u, "tanh"), _liger("geglu"), bytes_fwd=3 * Ng * Hg * esz, bytes_bwd=5 * Ng * Hg * esz)
    Ns, Cs = (8, 40) if tiny else (32768 // s, 8192)
    add("softmax", f"({Ns}, {Cs})", lambda: [t(Ns, Cs, scale=3.0)], K.softmax, R.softmax, _liger("softmax"),
        bytes_fwd=2 * Ns * Cs * esz, bytes_bwd=3 * Ns * Cs * esz)
    Nv, V = (8, 100) if tiny else (8192 // s, 128256)
    tgt = torch.randint(0, V, (Nv,), device=dev)
    add("cross_entropy", f"({Nv}, {V})", lambda: [t(Nv, V)], lambda z: K.cross_entropy(z, tgt),
        lambda z: R.cross_entropy(z, tgt), (lambda z, f=_liger("cross_entropy"): f(z, tgt)) if _liger("cross_entropy")
        else None, bytes_fwd=Nv * V * esz, bytes_bwd=2 * Nv * V * esz)
    Nq, Cq = (8, 64) if tiny else (16384 // s, 8192)
    for per_row in (False, True):
        add(f"fp8_quantize({'row' if per_row else 'tensor'})", f"({Nq}, {Cq})", lambda: [t(Nq, Cq, grad=False)],
            lambda x, p=per_row: K.fp8_quantize(x, per_row=p)[0], lambda x, p=per_row: R.fp8_quantize(x, per_row=p)[0],
            None, bytes_fwd=Nq * Cq * (esz + 1), backward=False)


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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cpu_bench(fn: Callable, grad_to_none: list | None = None) -> float:
    """Stand-in for do_bench in the CPU smoke run: one call, wall time in ms (exercises the harness only)."""
    for x in grad_to_none or ():
        x.grad = None
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def host_ms(fn: Callable, leaves: list, device_ms: float) -> float:
    """Median wall time of ``fn()`` started on an idle device without waiting for it: the host's share
    of a call (a call that syncs inside shows its device time too). Fewer repeats for slow calls."""
    times = []
    for _ in range(20 if device_ms < 5 else 5):
        for x in leaves:
            x.grad = None
        _sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync()  # the last call's grads stay, as after do_bench (the peak-memory pass starts from them)
    return statistics.median(times) * 1e3


def time_case(case: Case, name: str, fn: Callable, do_bench: Callable) -> dict:
    inputs = case.make()
    leaves = [x for x in inputs if x.requires_grad] + case.params
    y, first_s = first_call_s(fn, inputs)  # compiles a torch.compile'd provider's forward
    row: dict = {"first_call_s": first_s}
    if case.backward and leaves and not _outputs(y):  # a forward-only variant (e.g. an inference epilogue)
        leaves, row["note"] = [], "forward only"
    if case.backward and leaves:  # one untimed backward: compiles the backward graph before any timing
        t0 = time.perf_counter()
        outs = _outputs(y)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        _sync()
        row["first_call_s"] = first_s + time.perf_counter() - t0  # forward + backward compile, if any
        del outs
        for x in leaves:
            x.grad = None
        y = fn(*inputs)
    row["fwd_ms"] = do_bench(lambda: fn(*inputs))
    if case.backward and leaves:
        outs = _outputs(y)
        grads = [torch.randn_like(o) for o in outs]
        try:  # a compiled graph may refuse a second backward (retain_graph); fwd+bwd is still timed
            row["bwd_ms"] = do_bench(lambda: torch.autograd.backward(outs, grads, retain_graph=True),
                                     grad_to_none=leaves)
        except Exception as e:
            row["bwd_error"] = f"{type(e).__name__}: {e}"[:100]
        row["fwdbwd_ms"] = do_bench(lambda: _fwd_bwd(fn, inputs, grads), grad_to_none=leaves)
        row["host_ms"] = host_ms(lambda: _fwd_bwd(fn, inputs, grads), leaves, row["fwdbwd_ms"])
        if "bwd_error" in row:  # e.g. a compiled backward with donated buffers runs once per graph
            row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
            row["note"] = "bwd = fwdbwd - fwd: " + ("a compiled backward runs once per graph" if "donated" in
                                                   row.pop("bwd_error") else "bwd alone failed")
        del outs
    else:
        row["host_ms"] = host_ms(lambda: fn(*inputs), [], row["fwd_ms"])
    del y
    if torch.cuda.is_available():  # peak memory: CUDA only (the CPU smoke run skips it)
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
    for x in leaves:
        x.grad = None
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
                print(f"ok    {c.op:28s} {name}{'' if outs or not c.backward else ' (forward only)'}", flush=True)
            except Exception as e:  # peers (Liger, torchao, SDPA backends) may not run on CPU; ours must
                ours = name.startswith("torchnitro") or name in ("eager", "bf16")
                failed += ours
                print(f"{'FAIL' if ours else 'skip'}  {c.op:28s} {name}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    print("tuned configs:", json.dumps(tuned_configs(), indent=1) if tuned_configs() else "none exposed")
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # the whole pipeline once more: timing rows, ratios, targets, files
        table = ResultTable("smoke", COLUMNS)
        res = run_cases(cases, _cpu_bench, 1.0, table, trace="rms_norm", trace_prefix=os.path.join(d, "trace"))
        table.save("kernels_smoke", d)
        _plot(cases, res, "kernels_smoke", "cpu", d)
        rows_with_error = sum(1 for r in table.rows if "(" in str(r["provider"]) and "winners" not in str(r))
        print(f"pipeline: {len(table.rows)} rows, {rows_with_error} with an error or note; files "
              f"{sorted(os.listdir(d))}")
        for line in check_targets(cases, res):
            print("target:", line)
    return 1 if failed else 0


COLUMNS = ["op", "shape", "provider", "fwd_ms", "bwd_ms", "fwdbwd_ms", "host_ms", "peak_mb", "GB/s", "%copy_bw", "TFLOP/s",
           "bwd_TFLOP/s", "x_eager", "x_liger", "x_sdpa_best_fwd", "x_sdpa_best", "x_bf16", "x_torchao",
           "first_call_s"]


def _derive(c: Case, r: dict, bw: float) -> None:
    if "fwd_ms" in r:
        if c.bytes_fwd:
            r["GB/s"] = c.bytes_fwd / (r["fwd_ms"] * 1e-3) / 1e9
            r["%copy_bw"] = 100 * r["GB/s"] / bw
        if c.flops_fwd:
            r["TFLOP/s"] = c.flops_fwd / (r["fwd_ms"] * 1e-3) / 1e12
    if "bwd_ms" in r and c.flops_bwd:
        r["bwd_TFLOP/s"] = c.flops_bwd / (r["bwd_ms"] * 1e-3) / 1e12


def _row_names(c: Case) -> list[str]:
    """The providers of ``c``, then its synthetic "<prefix>_best" row when it has one."""
    return list(c.providers) + ([best_name(c)] if c.best_of else [])


def _ratios(c: Case, results: dict) -> None:
    """Speedups of every provider of ``c`` over its references: reference ms / provider ms."""
    key = "fwdbwd_ms" if c.backward else "fwd_ms"
    refs = {"x_eager": "eager", "x_liger": "liger", **c.ratios}
    for name in _row_names(c):
        r = results[(c.op, c.shape, name)]
        k = key if key in r else "fwd_ms"  # forward-only rows compare forwards
        for col, ref_name in refs.items():
            ref = results.get((c.op, c.shape, ref_name), {})
            if ref_name != name and k in r and k in ref:
                r[col] = ref[k] / r[k]
            if col == "x_sdpa_best" and ref_name != name and "fwd_ms" in r and "fwd_ms" in ref:
                r["x_sdpa_best_fwd"] = ref["fwd_ms"] / r["fwd_ms"]


def trace_case(case: Case, name: str, fn: Callable, path: str) -> str:
    """torch.profiler over 5 fwd+bwd (after 2 untimed) of one provider: the chrome trace goes to ``path``;
    returns the top events by self CPU time with their device time (where host and GPU time go)."""
    from torch.profiler import ProfilerActivity, profile

    inputs = case.make()
    leaves = [x for x in inputs if x.requires_grad] + case.params
    outs = _outputs(fn(*inputs))
    grads = [torch.randn_like(o) for o in outs]
    del outs

    def step():
        for x in leaves:
            x.grad = None
        if grads:
            _fwd_bwd(fn, inputs, grads)
        else:
            fn(*inputs)

    for _ in range(2):
        step()
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        _sync()
    prof.export_chrome_trace(path)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def run_cases(cases: list[Case], do_bench: Callable, bw: float, table: ResultTable,
              after_case: Callable[[], None] = lambda: None, trace: str = "", trace_prefix: str = "") -> dict:
    """Time every provider of every case, derive GB/s, TFLOP/s and speedups, fill ``table``. Cases whose op
    contains one of the comma-separated ``trace`` substrings are also profiled (``trace_case``), one chrome
    trace per provider at ``<trace_prefix>_<op>_<shape>_<provider>.json``."""
    from rich.progress import track

    results: dict[tuple[str, str, str], dict] = {}
    for c in track(cases, description="kernels"):
        for name, fn in c.providers.items():
            try:
                results[(c.op, c.shape, name)] = r = time_case(c, name, fn, do_bench)
                if trace and any(o and o in c.op for o in trace.split(",")):
                    tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{c.op}_{c.shape}_{name}").strip("_")
                    print(f"profile {c.op} {c.shape} {name}:\n" + trace_case(c, name, fn, f"{trace_prefix}_{tag}.json"),
                          flush=True)
            except Exception as e:  # one failing provider (OOM, missing op, no backend) must not stop the run
                results[(c.op, c.shape, name)] = r = {"error": f"{type(e).__name__}: {e}"[:160]}
                for x in c.params:
                    x.grad = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            _derive(c, r, bw)
        fold_best(c, results)
        if c.best_of:
            _derive(c, results[(c.op, c.shape, _row_names(c)[-1])], bw)
        _ratios(c, results)
        for name in _row_names(c):
            r = results[(c.op, c.shape, name)]
            label = name
            if "winners" in r:
                label = f"{name} ({r['winners']})"
            if "error" in r:
                label = f"{name} ({r['error']})"
            elif "note" in r:
                label = f"{name} ({r['note']})"
            table.add(op=c.op, shape=c.shape, provider=label, **{k: v for k, v in r.items() if k in table.columns})
        after_case()
    return results


def _result_name(gpu: str, tag: str) -> str:
    """``kernels_<gpu>[_<tag>]``, with the UTC date and time appended when that name is taken."""
    from torchnitro.bench import results_dir

    name = "kernels_" + re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    if tag:
        name += "_" + re.sub(r"[^A-Za-z0-9.-]+", "_", tag)
    d = results_dir()
    if any((d / f"{name}{ext}").exists() for ext in (".json", ".md", ".png")):
        name += "_" + time.strftime("%Y%m%dT%H%M", time.gmtime())
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, skip torch.compile")
    ap.add_argument("--smoke", action="store_true", help="CPU harness check on tiny shapes, no timing")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--ops", default="", help="comma-separated substrings of op names to run")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile provider of single ops (the FP8 block is always compiled)")
    ap.add_argument("--tag", default="", help="suffix of the result file names (kernels_<gpu>_<tag>)")
    ap.add_argument("--tuned", action="store_true", help="print the launch configs the kernels picked")
    ap.add_argument("--sizes", default="all", choices=["all", "issue21", "large"],
                    help="all: the issue-21 shapes, then the larger ones (default); issue21: the FP8 block and the "
                         "issue-21 shapes only; large: the larger shapes only")
    ap.add_argument("--issue21", action="store_true", help="same as --sizes issue21")
    ap.add_argument("--sweep", action="store_true", help="also the causal attention length sweep (T=1024..8192, batch 4)")
    ap.add_argument("--trace", default="", help="comma-separated op substrings: also profile those cases (torch.profiler "
                    "table printed, chrome trace in results/<name>_trace_*.json)")
    args = ap.parse_args(argv)
    if args.issue21:
        args.sizes = "issue21"
    dt = getattr(torch, args.dtype)
    if args.smoke:
        return smoke([c for c in build_cases("cpu", torch.float32, True, True, False, args.sizes)
                      if not args.ops or any(o in c.op for o in args.ops.split(","))])
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (none is visible). On CPU the fused ops run their PyTorch "
              "references, so there is nothing to compare; run `python benchmarks/kernels.py --smoke` to check the "
              "harness instead.", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    gpu = torch.cuda.get_device_name()
    name = _result_name(gpu, args.tag)
    bw = copy_bandwidth(do_bench)
    cases = [c for c in build_cases("cuda", dt, args.quick, False, not (args.quick or args.no_compile), args.sizes,
                                 args.sweep)
             if not args.ops or any(o in c.op for o in args.ops.split(","))]
    table = ResultTable(f"Fused kernels on {gpu} ({args.dtype})", COLUMNS,
                        meta={**provenance("benchmarks/kernels.py", argv, device="cuda"), "gpu": gpu,
                              "copy_bw_GBps": round(bw, 1), "dtype": args.dtype, "timer": "triton.testing.do_bench",
                              "peers": _peer_versions()})
    print(f"writing results/{name}.{{json,md,png}} (re-saved after every case)", flush=True)
    from torchnitro.bench import results_dir

    results = run_cases(cases, do_bench, bw, table, after_case=lambda: table.save(name), trace=args.trace,
                        trace_prefix=str(results_dir() / f"{name}_trace"))
    table.print()
    targets = check_targets(cases, results)
    table.meta["targets"] = "; ".join(targets) or "none measured"
    tuned = tuned_configs()
    table.meta["tuned_configs"] = tuned or "none exposed"
    table.save(name)
    try:
        _plot(cases, results, name, gpu)
    except Exception as e:  # the tables are written; a plotting problem must not lose them
        print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    if args.tuned:
        print("tuned configs:", json.dumps(tuned, indent=1) if tuned else "none exposed")
    for t in targets:  # last, so that a log tail shows them
        print(t)
    return 0


def _peer_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("liger-kernel", "torchao", "triton"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)


def _check(out: list[str], label: str, value: float | None, op: str, goal: float, fmt: str = "{:.2f}x") -> None:
    if value is None or not math.isfinite(value):
        out.append(f"{label}: not measured")
        return
    ok = value >= goal if op == ">=" else value <= goal
    out.append(f"{label} {fmt.format(value)} (target {op} {fmt.format(goal)}): {'PASS' if ok else 'MISS'}")


def check_targets(cases: list[Case], res: dict) -> list[str]:
    """The issue-21 goals, one line each (HRR bind >= 75% is checked by benchmarks/hrr.py)."""
    out: list[str] = []
    for c in cases:
        def g(p: str, k: str) -> float | None:
            return res.get((c.op, c.shape, p), {}).get(k)

        if c.op.startswith("flash_attention"):
            _check(out, f"{c.op} {c.shape} fwd vs sdpa_best", g("torchnitro", "x_sdpa_best_fwd"), ">=", 1.0)
            _check(out, f"{c.op} {c.shape} fwd+bwd vs sdpa_best", g("torchnitro", "x_sdpa_best"), ">=", 1.0)
        elif c.op.startswith("fp8_train"):
            _check(out, f"{c.op} train step vs bf16", g("torchnitro", "x_bf16"), ">=", 1.2)
            _check(out, f"{c.op} train step vs torchao float8", g("torchnitro", "x_torchao"), ">=", 1.0)
        elif c.op == "linear+cross_entropy":
            t_o, t_e, t_l = g("torchnitro", "fwdbwd_ms"), g("eager", "fwdbwd_ms"), g("liger", "fwdbwd_ms")
            m_o, m_e, m_l = g("torchnitro", "peak_mb"), g("eager", "peak_mb"), g("liger", "peak_mb")
            lbl = f"fused linear+CE {c.shape}"
            _check(out, f"{lbl} time vs eager", t_o / t_e if t_o and t_e else None, "<=", 1.15)
            _check(out, f"{lbl} peak memory vs eager", m_o / m_e if m_o and m_e else None, "<=", 0.35)
            _check(out, f"{lbl} time vs Liger", t_o / t_l if t_o and t_l else None, "<=", 1.0)
            _check(out, f"{lbl} peak memory vs Liger", m_o / m_l if m_o and m_l else None, "<=", 1.0)
        elif c.op in ("layer_norm", "rms_norm", "rope(q,k)"):
            bw_goal, liger_goal = {"layer_norm": (85, 1.1), "rms_norm": (85, 1.2), "rope(q,k)": (80, 1.1)}[c.op]
            lbl = f"{c.op} {c.shape}"
            _check(out, f"{lbl} fwd % of copy bandwidth", g("torchnitro", "%copy_bw"), ">=", bw_goal, "{:.0f}%")
            _check(out, f"{lbl} fwd+bwd vs Liger", g("torchnitro", "x_liger"), ">=", liger_goal)
        elif c.op == "linear+bias+gelu":
            for p in (p for p in c.providers if p.startswith("torchnitro")):
                phase = "fwd (forward-only variant)" if g(p, "note") == "forward only" else "fwd+bwd"
                _check(out, f"linear+bias+gelu {c.shape} {p} {phase} vs eager", g(p, "x_eager"), ">=", 1.0)
    out.append("HRR bind >= 75% of copy bandwidth: checked by benchmarks/hrr.py")
    return out


def _plot_ms(row: dict) -> float | None:
    """The time a plot bar compares: fwd+bwd where measured, else forward; None when the row has neither."""
    for key in ("fwdbwd_ms", "fwd_ms"):
        v = row.get(key)
        if isinstance(v, (int, float)) and v > 0 and not math.isnan(v):
            return float(v)
    return None


def _plot(cases: list[Case], res: dict, name: str, gpu: str, directory: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    provs = ["torchnitro", "compile", "liger", "torchao", "sdpa_best"]
    rows = []  # (label, {provider: speedup over the case's baseline}) for cases with a baseline and a bar
    for c in cases:
        ms = {p: _plot_ms(res.get((c.op, c.shape, p), {})) for p in provs + ["eager", "bf16"]}
        base = next((b for b in ("eager", "bf16", "sdpa_best") if ms[b]), None)
        bars = {p: ms[base] / ms[p] for p in provs if base and p != base and ms[p]}
        if bars:
            label = c.op if sum(d.op == c.op for d in cases) == 1 else f"{c.op} {c.shape}"
            rows.append((f"{label}\n(vs {base})", bars))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows) + 2), 5.5))
    width = 0.8 / len(provs)
    for i, p in enumerate(provs):
        ax.bar([j + (i - (len(provs) - 1) / 2) * width for j in range(len(rows))],
               [bars.get(p, math.nan) for _, bars in rows], width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs the row's baseline (fwd+bwd, else fwd)")
    ax.set_title(f"torchnitro fused kernels, {gpu}")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, name, directory)


if __name__ == "__main__":
    sys.exit(main())
