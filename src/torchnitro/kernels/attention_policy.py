"""Which attention runs where ``torchnitro`` replaces a model's attention: torch's SDPA or our flash kernel.

A user who patches a model (``kernels.patch_``, the ``fused-kernels`` recipe, ``torchnitro.nn.Attention``)
must never get slower attention than before. torch's ``scaled_dot_product_attention`` picks its own
fastest backend (cuDNN or FlashAttention-2 on Hopper) and on an H200 beat our Triton kernel at every
measured shape (results/kernels_nvidia_h200_20261126T1249.md, 0.30-0.78x of cuDNN). So, per call:

1. ``backend='sdpa'|'flash'`` (or ``TORCHNITRO_ATTENTION``) forces one; ``auto`` (default) decides:
2. a feature SDPA lacks goes to ours: a sliding window (SDPA needs a dense (Tq, Tk) mask for it,
   which rules out its cuDNN/flash backends), and grouped K/V on a torch without ``enable_gqa`` (< 2.5);
3. everything else is SDPA, unless a one-time measurement on this GPU shows ours at least
   ``MARGIN`` faster: on the first CUDA call per shape bucket both run (forward, or forward + backward
   when grads are wanted), interleaved, CUDA-event timed, median of ``ROUNDS``; the verdict is cached
   in-process. Never timed off CUDA, inside ``torch.compile``, in CUDA-graph capture, or with
   ``TORCHNITRO_KERNEL_TUNE=0``: those get SDPA (the safe default) until a measurement exists.

Every call site is recorded with its route and reason: ``attention_routes()`` (rows),
``attention_report()`` (text for the benchmark or ``doctor``), ``chosen_configs()`` (the benchmark's
``--tuned`` dump).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from torchnitro.errors import ConfigError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_qkv
from torchnitro.kernels._triton import cuda_ms, next_pow2, triton_importable
from torchnitro.kernels.dispatch import requested_backend
from torchnitro.kernels.flash_attention import flash_attention

__all__ = ["ATTENTION_BACKENDS", "MARGIN", "ROUNDS", "SDPA_HAS_GQA", "AttentionRoute", "attention", "sdpa",
           "route_attention", "interleaved_medians", "attention_routes", "attention_report", "chosen_configs",
           "reset_attention_routes", "policy_summary"]

ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
MARGIN = 0.05  # ours must be >= 5% faster than SDPA to be picked: within noise, keep what the user had
ROUNDS = 5  # interleaved timing rounds per backend; the median is compared
SDPA_HAS_GQA = torch.__version__ >= (2, 5)  # enable_gqa: grouped K/V without materialised repeats


@dataclass(frozen=True)
class AttentionRoute:
    """Where one attention call goes and why."""

    backend: str  # "sdpa" (torch picks cuDNN/flash/efficient/math) or "flash" (torchnitro's Triton kernel)
    reason: str  # one line: the feature, the measurement, or why nothing was measured
    ours_ms: float | None = None  # measured median of our kernel (None: not measured)
    sdpa_ms: float | None = None  # measured median of SDPA
    phase: str = ""  # what was timed: "fwd" or "fwd+bwd"


_MEASURED: dict[tuple, AttentionRoute] = {}  # shape bucket -> measured verdict (CUDA only)
_SITES: dict[tuple[str, tuple], AttentionRoute] = {}  # (call site, bucket) -> route, first call of each


def _requested(backend: str) -> str:
    env = os.environ.get("TORCHNITRO_ATTENTION", "auto").strip().lower() or "auto"
    for value, source in ((backend, "backend"), (env, "TORCHNITRO_ATTENTION")):
        if value not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention: {source}={value!r}; expected one of {list(ATTENTION_BACKENDS)}")
    return backend if backend != "auto" else env


def _effective_window(q: Tensor, k: Tensor, window: int | None) -> int | None:
    """None when the window masks nothing (every |q - k| < window), so the call is plain attention."""
    if window is not None and window >= max(q.shape[2], k.shape[2]):
        return None
    return window


def _wants_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _bucket(q: Tensor, k: Tensor, causal: bool, window: int | None, train: bool) -> tuple:
    """Lengths and B*H rounded up to powers of two; everything either backend specialises on."""
    B, H, Tq, D = q.shape
    return (str(q.dtype).replace("torch.", ""), next_pow2(max(B * H, 1)), H // k.shape[1], next_pow2(max(Tq, 1)),
            next_pow2(max(k.shape[2], 1)), D, "causal" if causal else "full", "window" if window else "",
            "fwd+bwd" if train else "fwd", str(q.device))


def _bucket_label(key: tuple) -> str:
    dt, bh, g, tq, tk, d, mask, win, phase, dev = key
    return (f"{dt} B*H<={bh} H/Hkv={g} Tq<={tq} Tk<={tk} D={d} {mask}{'+window' if win else ''} {phase} "
            f"{dev}")


def sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window: int | None = None,
         scale: float | None = None) -> Tensor:
    """torch's SDPA with torch's own backend choice; a window becomes a boolean mask."""
    H, Hkv = q.shape[1], k.shape[1]
    kw: dict = {"scale": scale}
    if H != Hkv:
        if SDPA_HAS_GQA:
            kw["enable_gqa"] = True
        else:  # only reached when SDPA is forced on an old torch
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)
    mask = reference.sliding_window_mask(q.shape[2], k.shape[2], causal, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def _unmeasurable(q: Tensor) -> str | None:
    """Why no timing can run for ``q`` now, or None when it can."""
    if not q.is_cuda:
        return f"{q.device.type} tensors: never timed off CUDA"
    if torch.compiler.is_compiling():
        return "inside torch.compile"
    if torch.cuda.is_current_stream_capturing():
        return "during CUDA-graph capture"
    if os.environ.get("TORCHNITRO_KERNEL_TUNE", "1").strip() == "0":
        return "TORCHNITRO_KERNEL_TUNE=0"
    return None


def interleaved_medians(a: Callable[[], object], b: Callable[[], object], time_ms: Callable[..., float],
                        rounds: int = ROUNDS, target_ms: float = 2.0) -> tuple[float, float]:
    """Median ms per call of ``a`` and ``b``: warm-up, then ``rounds`` rounds alternating which goes first,
    each round ``reps`` calls with ``reps`` sized so a round takes about ``target_ms``."""
    for fn in (a, b):
        time_ms(fn, 1)  # compile, pick launch configs, fill caches
    first = max(time_ms(a, 1), time_ms(b, 1), 1e-3)
    reps = int(min(50, max(1, math.ceil(target_ms / first))))
    ta: list[float] = []
    tb: list[float] = []
    for r in range(rounds):
        order = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
        for fn, out in order:
            out.append(time_ms(fn, reps))
    return statistics.median(ta), statistics.median(tb)


def _timed_call(f: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, train: bool) -> Callable[[], object]:
    if not train:
        def fwd() -> object:
            with torch.no_grad():
                return f(q, k, v)
        return fwd
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]  # the caller's graph is untouched
    wrt = [t for t in leaves if t.requires_grad]

    def fwd_bwd() -> object:
        with torch.enable_grad():
            out = f(*leaves)
            return torch.autograd.grad(out, wrt, out.detach())
    return fwd_bwd


def _measure(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, train: bool) -> AttentionRoute:
    """Time ours against SDPA on these inputs; SDPA unless ours is at least MARGIN faster."""
    phase = "fwd+bwd" if train else "fwd"
    ours = _timed_call(lambda a, b, c: flash_attention(a, b, c, causal=causal, scale=scale), q, k, v, train)
    theirs = _timed_call(lambda a, b, c: sdpa(a, b, c, causal=causal, scale=scale), q, k, v, train)
    try:
        t_ours, t_sdpa = interleaved_medians(ours, theirs, cuda_ms)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build or run here must not break the model
        try:
            interleaved_medians(theirs, theirs, cuda_ms, rounds=1)
        except Exception:  # noqa: BLE001 - SDPA fails too: keep SDPA, whose own error the real call raises
            return AttentionRoute("sdpa", f"measurement failed for both ({type(e).__name__}: {str(e)[:120]})")
        return AttentionRoute("sdpa", f"our kernel failed when measured ({type(e).__name__}: {str(e)[:120]})",
                              phase=phase)
    if t_ours <= (1.0 - MARGIN) * t_sdpa:
        why = f"measured {phase}: ours {t_ours:.4g} ms vs SDPA {t_sdpa:.4g} ms ({t_sdpa / t_ours:.2f}x)"
        return AttentionRoute("flash", why, t_ours, t_sdpa, phase)
    why = (f"measured {phase}: SDPA {t_sdpa:.4g} ms vs ours {t_ours:.4g} ms (ours {t_sdpa / t_ours:.2f}x of "
           f"SDPA, needs >= {1 / (1 - MARGIN):.2f}x)")
    return AttentionRoute("sdpa", why, t_ours, t_sdpa, phase)


def _decide(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None, scale: float | None,
            backend: str, key: tuple) -> AttentionRoute:
    req = _requested(backend)
    if req != "auto":
        return AttentionRoute(req, f"requested (backend={backend!r}, TORCHNITRO_ATTENTION="
                                   f"{os.environ.get('TORCHNITRO_ATTENTION', 'unset')!r})")
    if window is not None:
        return AttentionRoute("flash", "sliding window: SDPA has none (a dense (Tq, Tk) mask would rule out its "
                                       "cuDNN/flash backends); our kernel skips the masked blocks")
    if q.shape[1] != k.shape[1] and not SDPA_HAS_GQA:
        return AttentionRoute("flash", f"grouped K/V: torch {torch.__version__} SDPA has no enable_gqa (would "
                                       "materialise repeated K/V)")
    if q.shape[-1] > 256 or (scale is not None and not scale > 0):
        return AttentionRoute("sdpa", "outside our kernel's range (head dim > 256 or scale <= 0)")
    if requested_backend() == "reference" or not triton_importable():
        return AttentionRoute("sdpa", "our kernel cannot run here (TORCHNITRO_KERNELS=reference or no triton)")
    cached = _MEASURED.get(key)
    if cached is not None:
        return cached
    why_not = _unmeasurable(q)
    if why_not is not None:
        return AttentionRoute("sdpa", f"SDPA by default, not measured ({why_not})")
    route = _MEASURED[key] = _measure(q, k, v, causal, scale, key[8] == "fwd+bwd")
    return route


def route_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window: int | None = None,
                    scale: float | None = None, backend: str = "auto", site: str | None = None) -> AttentionRoute:
    """The route of one call (see the module docstring); recorded under ``site`` when given.

    May time both backends once (first CUDA call of a shape bucket, ``backend='auto'``)."""
    check_qkv("attention", q, k, v, window)
    window = _effective_window(q, k, window)
    key = _bucket(q, k, causal, window, _wants_grad(q, k, v))
    route = _decide(q, k, v, causal, window, scale, backend, key)
    if site is not None and not torch.compiler.is_compiling() and (site, key) not in _SITES:
        _SITES[(site, key)] = route
    return route


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window: int | None = None,
              scale: float | None = None, *, backend: str = "auto", site: str = "attention") -> Tensor:
    """softmax(q k^T * scale + mask) v, (B, H, Tq, D) from q (B, H, Tq, D), k/v (B, Hkv, Tk, D), on the
    backend :func:`route_attention` picks. Masks as :func:`~torchnitro.kernels.flash_attention`."""
    route = route_attention(q, k, v, causal, window, scale, backend, site)
    window = _effective_window(q, k, window)
    if route.backend == "flash":
        return flash_attention(q, k, v, causal=causal, window=window, scale=scale)
    return sdpa(q, k, v, causal=causal, window=window, scale=scale)


def attention_routes() -> list[dict[str, object]]:
    """One row per (call site, shape bucket) seen in this process: site, bucket, backend, reason, times."""
    return [{"site": site, "bucket": _bucket_label(key), **asdict(r)} for (site, key), r in _SITES.items()]


def attention_report() -> str:
    """The routes as text, one line per call site and bucket."""
    rows = attention_routes()
    if not rows:
        return "attention routes: no patched attention has run in this process"
    return "\n".join(["attention routes:"] + [f"  {r['site']} [{r['bucket']}] -> {r['backend']}: {r['reason']}"
                                              for r in rows])


def chosen_configs() -> dict[str, str]:
    """``"site bucket" -> "backend: reason"`` (what the kernel benchmark's ``--tuned`` lists)."""
    return {f"{r['site']} {r['bucket']}": f"{r['backend']}: {r['reason']}" for r in attention_routes()}


def reset_attention_routes() -> None:
    """Forget measurements and recorded sites (tests; a changed GPU clock or driver)."""
    _MEASURED.clear()
    _SITES.clear()


def policy_summary() -> str:
    """The policy in one paragraph, with what this machine can do (for ``doctor``)."""
    forced = os.environ.get("TORCHNITRO_ATTENTION", "auto").strip().lower() or "auto"
    where = "timed once per shape bucket on CUDA" if torch.cuda.is_available() else "no CUDA: never timed"
    return (f"attention in patched models: TORCHNITRO_ATTENTION={forced}; auto = torch SDPA (torch picks "
            f"cuDNN/flash) unless ours is >= {MARGIN:.0%} faster ({where}); sliding windows"
            f"{'' if SDPA_HAS_GQA else ' and grouped K/V'} use torchnitro flash attention")
