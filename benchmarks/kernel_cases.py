"""Cases of benchmarks/kernels.py beyond the single fused ops: attention against every SDPA backend,
an FP8 training block against bf16 and torchao, the Linear+bias+GELU variants the kernel module
exports, and the launch configs the kernels picked (``--tuned``).

Every provider that cannot be built (a peer not installed, an SDPA backend this GPU lacks) becomes a
provider that raises its reason, so the row records why and the run goes on.
"""

from __future__ import annotations

import copy
import importlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
PHASES = ("fwd_ms", "bwd_ms", "fwdbwd_ms")


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
    best_of: tuple[str, ...] = ()  # providers folded into a synthetic "<prefix>_best" row (min per phase)
    ratios: dict[str, str] = field(default_factory=dict)  # extra column -> reference provider (ref_ms / ms)
    issue21: bool = False  # an issue-21 shape (``--issue21`` keeps only these; targets say which shape)


def failing(reason: str) -> Callable[..., torch.Tensor]:
    """A provider that could not be built: calling it raises ``reason`` (recorded in its row)."""

    def fn(*_args):
        raise RuntimeError(reason)

    return fn


def _sdpa(backend: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend, None)
    if be is None:
        return failing(f"SDPBackend.{backend} does not exist in torch {torch.__version__}")

    def fn(q, k, v, causal):
        with sdpa_kernel(be):  # only this backend: no silent fallback to another one
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def attention_cases(dev: str, t: Callable, tiny: bool, flash: Callable, ref: Callable, batch: int = 4,
                    shapes: list[tuple[bool, int]] | None = None) -> list[Case]:
    """Ours vs each SDPA backend separately (+ "sdpa_best") at ``batch``, for each (causal, T) of
    ``shapes`` (default: plain and causal at T=4096, with eager beside them).

    FLOPs: forward 4*B*H*T*T*D (QK^T and PV), halved for causal; backward 2.5x forward."""
    Ba, Ha, Ta, Da = (1, 2, 32, 16) if tiny else (batch, 16, 4096, 128)
    cases = []
    for causal, T in shapes or [(False, Ta), (True, Ta)]:
        fl = 4 * Ba * Ha * T * T * Da * (0.5 if causal else 1.0)
        prov = {"torchnitro": lambda q, k, v, c=causal: flash(q, k, v, causal=c)}
        if shapes is None:
            prov["eager"] = lambda q, k, v, c=causal: ref(q, k, v, causal=c)
        for name, backend in SDPA_BACKENDS.items():  # on CPU (smoke) the ones without a CPU kernel record why
            prov[name] = lambda q, k, v, c=causal, f=_sdpa(backend): f(q, k, v, c)
        cases.append(Case(f"flash_attention{' causal' if causal else ''}", f"({Ba},{Ha},{T},{Da})",
                          lambda T=T: [t(Ba, Ha, T, Da) for _ in range(3)], prov, flops_fwd=fl, flops_bwd=2.5 * fl,
                          best_of=tuple(SDPA_BACKENDS), ratios={"x_sdpa_best": "sdpa_best"}))
    return cases


class LlamaBlock(nn.Module):
    """Attention output projection + SwiGLU MLP of one Llama-3-8B layer (no attention core, no norms):
    ``h = x + wo(x); y = h + w2(silu(w1 h) * w3 h)``; every matmul is an ``nn.Linear`` without bias."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, dim) -> (N, dim)
        h = x + self.wo(x)
        return h + self.w2(F.silu(self.w1(h)) * self.w3(h))


def fp8_train_case(dev: str, dt: torch.dtype, tiny: bool, compile_models: bool) -> Case:
    """Train step (forward + backward, no optimizer) of a Llama-3-8B block (dim 4096, SwiGLU FFN
    14336, 8192 tokens): bf16 vs ours (``to_float8_``, dynamic scaling) vs torchao float8 training
    (``convert_to_float8_training``, default dynamic tensorwise recipe), each ``torch.compile``d the
    same way (mode default, one block, so compile time stays bounded)."""
    dim, ffn, tokens = (32, 64, 16) if tiny else (4096, 14336, 8192)
    torch.manual_seed(0)
    base = LlamaBlock(dim, ffn).to(dev, dt)
    models: dict[str, nn.Module | Callable] = {"bf16": base}
    try:
        from torchnitro.precision import to_float8_

        models["torchnitro"] = to_float8_(copy.deepcopy(base), skip=())
    except Exception as e:
        models["torchnitro"] = failing(f"to_float8_: {type(e).__name__}: {e}")
    try:
        from torchao.float8 import convert_to_float8_training

        models["torchao"] = convert_to_float8_training(copy.deepcopy(base))
    except Exception as e:  # not installed, or an API change
        models["torchao"] = failing(f"torchao float8: {type(e).__name__}: {e}")
    params = [p for m in models.values() if isinstance(m, nn.Module) for p in m.parameters()]
    prov = {name: (torch.compile(m) if compile_models and isinstance(m, nn.Module) else m) for name, m in models.items()}
    fl = 2 * tokens * (dim * dim + 3 * dim * ffn)
    name = "fp8_train Llama3-8B block" + ("" if compile_models else " (eager)")
    return Case(name, f"tokens {tokens} dim {dim} ffn {ffn}",
                lambda: [(torch.randn(tokens, dim, device=dev) * 0.5).to(dt).requires_grad_(True)], prov,
                flops_fwd=fl, flops_bwd=2 * fl, params=params, ratios={"x_bf16": "bf16", "x_torchao": "torchao"})


def linear_gelu_variants() -> dict[str, Callable]:
    """Every functional ``linear_gelu*`` the kernel module exports besides ``linear_gelu`` itself
    (e.g. an epilogue variant), as ``"torchnitro:<name>" -> fn(x, w, b)``; none when it has none."""
    try:
        mod = importlib.import_module("torchnitro.kernels.linear_gelu")
    except Exception:
        return {}
    out = {}
    for name in getattr(mod, "__all__", ()):
        fn = getattr(mod, name, None)
        if (name != "linear_gelu" and name.startswith("linear_gelu") and not name.endswith(("_forward", "_backward"))
                and callable(fn) and not isinstance(fn, type)):
            out[f"torchnitro:{name}"] = _inference_if_refused(fn)
    return out


def _inference_if_refused(fn: Callable) -> Callable:
    """``fn``, or ``fn`` under ``torch.no_grad()`` when its first call refuses inputs that require grad
    (an inference-only variant); the benchmark then times its forward only."""
    mode: dict[str, bool] = {}

    def call(*args):
        if mode.get("inference"):
            with torch.no_grad():
                return fn(*args)
        try:
            y = fn(*args)
        except Exception:
            if mode:  # it ran with grads before: a real failure
                raise
            with torch.no_grad():
                y = fn(*args)
            mode["inference"] = True
            return y
        mode.setdefault("inference", False)
        return y

    return call


def tuned_configs() -> dict[str, object]:
    """Launch configs the kernels picked in this process, from whatever each kernel module exposes
    (``chosen_configs()`` / ``tuned_configs()`` functions, or ``_TUNED`` / ``_CHOSEN`` dicts)."""
    out: dict[str, object] = {}
    for short in ("_triton", "flash_attention", "attention_policy", "layer_norm", "rms_norm", "rope", "linear_gelu",
                  "fused_linear_ce"):
        try:
            mod = importlib.import_module(f"torchnitro.kernels.{short}")
        except Exception:
            continue
        for attr in ("chosen_configs", "tuned_configs", "_TUNED", "_CHOSEN"):
            v = getattr(mod, attr, None)
            try:
                v = v() if callable(v) else v
            except Exception as e:
                v = f"<{type(e).__name__}: {e}>"
            if isinstance(v, dict) and v:
                out[f"{short}.{attr}"] = {str(k): (str(c) if not isinstance(c, (int, float, str)) else c)
                                          for k, c in v.items()}
    return out


def best_name(case: Case) -> str:
    """Name of the synthetic row of ``case.best_of``: "sdpa_best" for the "sdpa_*" providers."""
    return case.best_of[0].split("_")[0] + "_best"


def fold_best(case: Case, results: dict) -> None:
    """Add the synthetic "<prefix>_best" row of ``case``: the minimum of ``best_of`` per phase."""
    if not case.best_of:
        return
    prefix = case.best_of[0].split("_")[0]
    best: dict = {}
    winners = []
    for ph in PHASES:
        got = [(results.get((case.op, case.shape, p), {}).get(ph), p) for p in case.best_of]
        got = [(ms, p) for ms, p in got if ms is not None]
        if got:
            ms, p = min(got)
            best[ph] = ms
            winners.append(f"{ph.removesuffix('_ms')}:{p.removeprefix(prefix + '_')}")
    best["winners"] = " ".join(winners) if winners else "no backend ran"
    if not winners:
        best["error"] = "no SDPA backend ran"
    results[(case.op, case.shape, best_name(case))] = best


def first_call_s(fn: Callable, inputs: list) -> tuple[object, float]:
    """``fn(*inputs)`` and its wall time in seconds (for compiled providers: the compile time of the forward)."""
    t0 = time.perf_counter()
    y = fn(*inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return y, time.perf_counter() - t0
