"""Host (Python/CPU) time per call of the norm and RoPE ops, torchnitro vs Liger-Kernel, without a GPU.

Why: on an H200 the norm kernels are faster than the host can launch them (results/kernels_nvidia_h200_*:
RMSNorm's backward kernels take 0.11 ms, the benchmark's backward 0.25 ms), so the GPU idles and
the host path is what is measured. This script times that host path alone.

Method (the same for both sides):

- every Triton launch is stubbed: ``triton.runtime.jit.JITFunction.run`` (what ``kernel[grid](...)``
  calls, for our LazyKernel-built kernels and Liger's ``@triton.jit`` ones alike) returns at once,
  after counting the launch. Triton's own launch path (argument binding, specialisation key, driver
  call) is therefore NOT in the numbers; it costs the same per launch on both sides, so the table
  lists launches per call beside the time;
- tensors are small CPU tensors, bfloat16, with the issue-21 inner sizes (C = 4096; 32/8 heads of
  128) but only 16 rows / positions: the host path does not depend on the row count, and few rows
  keep CPU allocations and the few small ATen ops (Liger's ``zeros_like``, ``sum``, ``to``) about
  as cheap as the allocator call or launch they are on CUDA (``meta`` tensors are no proxy: their
  ``empty_like`` runs a Python decomposition); one intra-op thread;
- our dispatcher is told Triton can run on CPU tensors as on CUDA ones (``dispatch._TRITON_DEVICES``
  gains "cpu"; on code without that fast check, ``dispatch._triton_blocker`` -> None) and
  ``pick_config`` caches its default on the first call, as it caches its measured pick on CUDA, so
  the steady state is the one a GPU run sees after its first call. CUDA-only queries are not made
  on CPU tensors on either side (ours: SM count, now cached; Liger: ``torch.cuda.device`` context
  and ``get_device_properties`` per backward), which flatters Liger slightly;
- x_liger = Liger's host time / ours (> 1: ours is cheaper), from the medians and from the minima (the
  best sample of each: on a shared, loaded machine noise only ever adds time);
- phases as in benchmarks/kernels.py: fwd (inputs require grad, graph built), bwd
  (``torch.autograd.backward(..., retain_graph=True)``, leaf grads reset to None inside the timed call),
  fwd+bwd; timed as this thread's CPU time (``time.thread_time_ns``; on CPU tensors autograd runs the
  backward on the calling thread), not wall time, because on a shared machine wall time also counts
  the other processes; samples of k calls, providers interleaved round by round (rotating order),
  warm-up first; median, p90 and min of the per-call samples;
- ATen ops per call are counted with a TorchDispatchMode: allocations (empty*) and other non-view ops
  (each a kernel launch on CUDA, e.g. Liger's ``sum`` + ``to`` of the dW partials).

    python benchmarks/host_overhead.py              # table, results/host_overhead_cpu.{md,json}
    python benchmarks/host_overhead.py --profile rms_norm   # cProfile of our fwd+bwd, top functions
    python benchmarks/host_overhead.py --quick      # short timing (harness check)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterator

os.environ.pop("TRITON_INTERPRET", None)  # kernels are built as for a GPU (their launches are stubbed)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode

torch.set_num_threads(1)  # small ATen ops stand for CUDA launches: no intra-op thread pool spin-ups

from torchnitro.bench import ResultTable  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.bench.timing import Timing  # noqa: E402

ROWS = 16  # rows (norms) and positions (RoPE): the host path is the same for 4096 of them
_LAUNCHES = Counter()
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "detach", "alias", "as_strided", "expand", "t", "transpose",
             "unsqueeze", "squeeze", "slice", "select", "permute", "split", "unbind", "_reshape_alias"}


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """Triton launches return at once (counted); our dispatch and pick_config act as on a warmed-up GPU."""
    from triton.runtime.jit import JITFunction

    from torchnitro.kernels import _triton, dispatch

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        _LAUNCHES[getattr(self, "__name__", "?")] += 1

    saved = [(JITFunction, "run", JITFunction.run), (dispatch, "_triton_blocker", dispatch._triton_blocker),
             (_triton, "tuning_enabled", _triton.tuning_enabled),
             (_triton, "_time_candidates", _triton._time_candidates)]
    if hasattr(dispatch, "_TRITON_DEVICES"):  # the fast check, as it answers for a CUDA tensor
        saved.append((dispatch, "_TRITON_DEVICES", dispatch._TRITON_DEVICES))
        dispatch._TRITON_DEVICES = ("cuda", "cpu")
    JITFunction.run = run
    dispatch._triton_blocker = lambda device: None
    _triton.tuning_enabled = lambda device: True
    _triton._time_candidates = lambda candidates, run, **kw: {0: 1.0}  # the default wins and is cached
    try:
        yield
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _t(*shape: int, grad: bool = True, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def _liger_ops() -> dict[str, Callable[..., Any]] | str:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as e:  # noqa: BLE001 - not installed or an API change: our rows still run
        return f"{type(e).__name__}: {e}"
    return {"rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False),
            "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
            "rope": liger_rotary_pos_emb}


def cases() -> list[tuple[str, str, Callable[[], list[torch.Tensor]], dict[str, Callable[..., Any]]]]:
    """(op, shape, make inputs, providers): the issue-21 shapes."""
    from torchnitro import kernels as K

    N, C = ROWS, 4096
    B, H, Hk, T, D = 1, 32, 8, ROWS, 128
    cos, sin = _t(T, D // 2, grad=False, dtype=torch.float32), _t(T, D // 2, grad=False, dtype=torch.float32)
    cos_hf, sin_hf = _t(1, T, D, grad=False, dtype=torch.float32), _t(1, T, D, grad=False, dtype=torch.float32)
    lig = _liger_ops()
    out = []
    for op, shape, make, ours, liger in (
        ("rms_norm", f"({N}, {C})", lambda: [_t(N, C), _t(C)], lambda x, w: K.rms_norm(x, w, 1e-6),
         lambda f: (lambda x, w: f(x, w))),
        ("layer_norm", f"({N}, {C})", lambda: [_t(N, C), _t(C), _t(C)], K.layer_norm,
         lambda f: (lambda x, w, b: f(x, w, b))),
        ("rope(q,k)", f"q({B},{H},{T},{D}) k({B},{Hk},{T},{D})", lambda: [_t(B, H, T, D), _t(B, Hk, T, D)],
         lambda q, k: K.apply_rope(q, k, cos, sin), lambda f: (lambda q, k: f(q, k, cos_hf, sin_hf))),
    ):
        prov = {"torchnitro": ours}
        key = op.split("(")[0]
        if isinstance(lig, dict):
            prov["liger"] = liger(lig[key])
        out.append((op, shape, make, prov))
    return out


def _outs(y: Any) -> list[torch.Tensor]:
    return [o for o in (y if isinstance(y, (tuple, list)) else (y,)) if isinstance(o, torch.Tensor) and o.requires_grad]


def phases(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """fwd, bwd (retained graph) and fwd+bwd closures, as benchmarks/kernels.py times them."""
    leaves = [x for x in inputs if x.requires_grad]
    outs = _outs(fn(*inputs))
    grads = [torch.randn_like(o) for o in outs]

    def bwd() -> None:
        for x in leaves:
            x.grad = None
        torch.autograd.backward(outs, grads, retain_graph=True)

    def fwdbwd() -> None:
        for x in leaves:
            x.grad = None
        torch.autograd.backward(_outs(fn(*inputs)), grads)

    return {"fwd": lambda: fn(*inputs), "bwd": bwd, "fwd+bwd": fwdbwd}


def cpu_compare(fns: dict[str, Callable[[], Any]], rounds: int, calls: int, warmup: int = 50) -> dict[str, Timing]:
    """Thread CPU time per call of each function, ``rounds`` samples of ``calls`` calls, interleaved (``Timing``'s
    statistics over CPU seconds per call)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[n]
            t0 = time.thread_time_ns()
            for _ in range(calls):
                fn()
            samples[n].append((time.thread_time_ns() - t0) / 1e9 / calls)
    return {n: Timing(v) for n, v in samples.items()}


def count(call: Callable[[], Any]) -> tuple[int, int, int, str]:
    """(Triton launches, allocations, other non-view ATen ops, their names) of one call."""
    _LAUNCHES.clear()
    with _CountOps() as m:
        call()
    allocs = sum(n for op, n in m.ops.items() if op.startswith(("empty", "new_empty")))
    other = {op: n for op, n in m.ops.items() if op not in _VIEW_OPS and not op.startswith(("empty", "new_empty"))}
    return sum(_LAUNCHES.values()), allocs, sum(other.values()), " ".join(f"{k}x{v}" for k, v in sorted(other.items()))


def profile(op: str, n: int = 3000, top: int = 30) -> None:
    with stubbed():
        for name, _, make, prov in cases():
            if op in name:
                f = phases(prov["torchnitro"], make())["fwd+bwd"]
                for _ in range(50):
                    f()
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(n):
                    f()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short timing (harness check)")
    ap.add_argument("--profile", default="", help="cProfile our fwd+bwd of this op instead of the table")
    ap.add_argument("--name", default="host_overhead_cpu", help="results/<name>.{md,json}")
    ap.add_argument("--note", default="", help="a line for the table's metadata (e.g. which code was measured)")
    args = ap.parse_args(argv)
    if args.profile:
        profile(args.profile)
        return 0
    rounds, calls_per_sample = (3, 5) if args.quick else (41, 50)
    cols = ["op", "shape", "phase", "provider", "host_us", "min_us", "p90_us", "cv", "x_liger", "x_liger_min",
            "triton_launches", "allocs", "aten_ops", "ops"]
    lig = _liger_ops()
    table = ResultTable("Host CPU time per call, Triton launches stubbed, small CPU tensors (bfloat16)", cols, meta={
        **provenance("benchmarks/host_overhead.py", argv), "method": "see the script's docstring",
        "liger": "liger-kernel " + _version("liger-kernel") if isinstance(lig, dict) else f"not available ({lig})",
        "torchnitro imported from": os.path.dirname(__import__("torchnitro").__file__),
        **({"note": args.note} if args.note else {})})
    with stubbed():
        for op, shape, make, prov in cases():
            calls = {name: phases(fn, make()) for name, fn in prov.items()}
            for ph in ("fwd", "bwd", "fwd+bwd"):
                res = cpu_compare({name: c[ph] for name, c in calls.items()}, rounds, calls_per_sample)
                for name in prov:
                    t = res[name]
                    launches, allocs, other, names = count(calls[name][ph])
                    lig = res.get("liger") if name != "liger" else None
                    table.add(op=op, shape=shape, phase=ph, provider=name, host_us=t.median * 1e6, min_us=t.min * 1e6,
                              p90_us=t.p90 * 1e6, cv=t.cv, x_liger=lig.median / t.median if lig else None,
                              x_liger_min=lig.min / t.min if lig else None, triton_launches=launches, allocs=allocs,
                              aten_ops=other, ops=names or "-")
                    print(f"{op:10s} {ph:8s} {name:11s} median {t.median * 1e6:7.1f} us  min {t.min * 1e6:7.1f} us  "
                          f"launches {launches} allocs {allocs} ops {names or '-'}", flush=True)
    table.save(args.name)
    return 0


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    sys.exit(main())
