"""Benchmark suites over a fixed size matrix: what ``torchnitro bench run`` times and writes.

Tiers are batch x heads x seq x head_dim (issue 19's matrix); each tier has its own time limit,
shared by its cases, and is skipped with a stated reason when its working set would take more
than half of the device's free memory. The cases of a tier are timed interleaved with
``bench.compare``. Suites (``SUITES``, filled by ``register_suite``):

- ``attention``: causal SDPA against the math reference (matmul, mask, softmax, matmul);
- ``fused``: torchnitro's fused kernels against eager PyTorch at (batch*seq, heads*head_dim);
- ``train``: a transformer LM train step, eager against ``kernels.patch_``;
- ``models``: the built-in models ``optimize`` works on, eager forward at the tier's batch and seq.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from torchnitro.bench.results import MIN_SAMPLES
from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError

__all__ = ["TIERS", "TIER_LIMIT_S", "SUITES", "Suite", "SuiteRun", "register_suite", "run_suite",
           "free_memory_bytes"]

TIERS: dict[str, tuple[int, int, int, int]] = {  # name -> (batch, heads, seq, head_dim)
    "micro": (1, 2, 32, 16), "small": (1, 4, 64, 32), "realistic": (2, 8, 512, 64),
    "large": (4, 16, 1024, 64), "xlarge": (8, 32, 2048, 128),
}
TIER_LIMIT_S = {"micro": 10.0, "small": 15.0, "realistic": 60.0, "large": 120.0, "xlarge": 300.0}  # per tier


@dataclass
class SuiteRun:
    timings: dict[str, Timing] = field(default_factory=dict)  # "suite/tier/case" -> timing
    skipped: dict[str, str] = field(default_factory=dict)  # "suite/tier" -> why


def free_memory_bytes(device: str) -> int:
    """Free bytes on ``device``: CUDA's free memory, or the host's available memory."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _attention_bytes(shape: tuple[int, int, int, int]) -> int:
    """fp32 working set of the math path: (B, H, T, T) scores, mask and softmax, plus q, k, v, out."""
    b, h, t, d = shape
    return 4 * (3 * b * h * t * t + 4 * b * h * t * d)


def _attention(shape: tuple[int, int, int, int], device: str) -> dict[str, Callable[[], Any]]:
    b, h, t, d = shape
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(device, dtype) for _ in range(3))
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()

    def math() -> torch.Tensor:
        s = (q @ k.transpose(-2, -1)) * d ** -0.5  # (B, H, T, T)
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"sdpa": sdpa, "math": math}


_Shape = tuple[int, int, int, int]


@dataclass(frozen=True)
class Suite:
    build: Callable[[_Shape, str], dict[str, Callable[[], Any]]]  # (tier shape, device) -> case name -> call
    need: Callable[[_Shape, str], int]  # bytes a tier needs on the device (checked before building it)
    grad: bool = False  # the cases run backward: timed outside inference_mode
    about: str = ""  # one line for --help and the docs


SUITES: dict[str, Suite] = {}


def register_suite(name: str, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``build(shape, device)`` as suite ``name`` (``kw``: the other ``Suite`` fields)."""

    def deco(build: Callable[..., Any]) -> Callable[..., Any]:
        SUITES[name] = Suite(build, **kw)
        return build
    return deco


def _elem(device: str) -> int:
    return 2 if device.startswith("cuda") else 4


register_suite("attention", need=lambda shape, dev: _attention_bytes(shape),
               about="causal SDPA vs the math reference (matmul, mask, softmax, matmul)")(_attention)


@register_suite("fused", need=lambda s, dev: _elem(dev) * s[0] * s[2] * s[1] * s[3] * 12,
                about="torchnitro.kernels (Triton on CUDA) vs eager PyTorch: rms_norm, layer_norm, rope, swiglu "
                      "on (batch*seq, heads*head_dim) rows")
def _fused(shape: _Shape, device: str) -> dict[str, Callable[[], Any]]:
    from torch.nn import functional as F

    from torchnitro import kernels
    from torchnitro.kernels import reference

    b, h, t, d = shape
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, dtype)

    x, w, bias = rand(b * t, h * d), rand(h * d), rand(h * d)  # (N, C): one row per token
    gate, up = rand(b * t, 2 * h * d), rand(b * t, 2 * h * d)  # (N, 2C): the MLP's hidden width
    q = rand(b, h, t, d)  # (B, H, T, D)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(d // 2) / (d // 2)))[None]
    cos, sin = pos.cos().to(device, dtype), pos.sin().to(device, dtype)  # (T, D/2)
    return {"rms_norm/torchnitro": lambda: kernels.rms_norm(x, w),
            "rms_norm/eager": lambda: F.rms_norm(x, (h * d,), w, 1e-6),
            "layer_norm/torchnitro": lambda: kernels.layer_norm(x, w, bias),
            "layer_norm/eager": lambda: F.layer_norm(x, (h * d,), w, bias),
            "rope/torchnitro": lambda: kernels.rope(q, cos, sin),
            "rope/eager": lambda: reference.rope(q, cos, sin),
            "swiglu/torchnitro": lambda: kernels.swiglu(gate, up),
            "swiglu/eager": lambda: F.silu(gate) * up}


def _lm_config(shape: _Shape) -> Any:
    from torchnitro.nn.models import TransformerConfig

    b, h, t, d = shape
    return TransformerConfig(vocab_size=2048, dim=h * d, n_layers=2, n_heads=h, max_seq_len=t)


def _train_bytes(shape: _Shape, device: str) -> int:
    cfg = _lm_config(shape)
    b, h, t, _ = shape
    params = cfg.vocab_size * cfg.dim + cfg.n_layers * (4 * cfg.dim ** 2 + 3 * cfg.dim * cfg.hidden_dim)
    acts = b * t * (cfg.n_layers * (12 * cfg.dim + 3 * cfg.hidden_dim) + 3 * cfg.vocab_size)
    return 4 * 3 * params + _elem(device) * 2 * acts  # fp32 weights, grads, update temp; activations and grads


@register_suite("train", need=_train_bytes, grad=True,
                about="a 2-layer pre-norm transformer LM train step (forward, cross-entropy, backward, SGD) at "
                      "dim heads*head_dim: eager vs kernels.patch_ (fused norms, SwiGLU, RoPE)")
def _train(shape: _Shape, device: str) -> dict[str, Callable[[], Any]]:
    import copy

    from torchnitro.kernels import patch_
    from torchnitro.nn.models import TransformerLM

    b, _, t, _ = shape
    cfg = _lm_config(shape)
    torch.manual_seed(0)
    eager = TransformerLM(cfg).to(device).train()
    fused = copy.deepcopy(eager)
    patch_(fused)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g).to(device)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]  # (B, T) each

    def step_of(model: torch.nn.Module) -> Callable[[], Any]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> Any:
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                logits = model(inp)  # (B, T, V)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step
    return {"eager": step_of(eager), "fused": step_of(fused)}


def _models_bytes(shape: _Shape, device: str) -> int:
    b, _, t, _ = shape
    return 4 * b * t * (8192 * 2 + 4 * t + 64 * 256)  # LM logits, 4-head scores, activations of the built-ins


@register_suite("models", need=_models_bytes,
                about="the built-in models optimize works on (encoder, lm, mlp, cnn), eager forward at the tier's "
                      "batch and seq")
def _models(shape: _Shape, device: str) -> dict[str, Callable[[], Any]]:
    from torchnitro.nn.zoo import get_builtin

    b, _, t, _ = shape
    out: dict[str, Callable[[], Any]] = {}
    for name in ("encoder", "lm", "mlp", "cnn"):
        spec = get_builtin(name)
        model = spec.build().to(device)
        args = tuple(a.to(device) for a in spec.inputs(b, t, 0))
        out[name] = (lambda m, a: lambda: m(*a))(model, args)
    return out


def run_suite(suite: str, tiers: Sequence[str], *, device: str = "cpu", timing: TimingConfig | None = None,
              free_bytes: int | None = None) -> SuiteRun:
    """Time every case of ``suite`` at each tier; ``free_bytes`` overrides the measured free memory.

    A case that raises on its first call (a shape a model does not take, a kernel this device lacks)
    is skipped with the error as its reason; the tier's other cases are still timed.
    """
    if suite not in SUITES:
        raise InputError(f"suite {suite!r} is unknown; expected one of {sorted(SUITES)}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise InputError(f"tiers {list(tiers)}: {unknown or 'none given'}; expected some of {list(TIERS)}")
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    out = SuiteRun()
    spec = SUITES[suite]
    for tier in tiers:
        need = spec.need(TIERS[tier], device)
        if need > free // 2:  # decided before allocating anything
            out.skipped[f"{suite}/{tier}"] = (f"needs about {need / 2**20:.0f} MiB, more than half of "
                                              f"the {free / 2**20:.0f} MiB free on {device}")
            continue
        with contextlib.ExitStack() as stack:
            if not spec.grad:
                stack.enter_context(torch.inference_mode())
            try:
                fns = spec.build(TIERS[tier], device)
            except Exception as exc:  # one tier failing to build must not lose the others
                out.skipped[f"{suite}/{tier}"] = f"could not be built: {type(exc).__name__}: {exc}"
                continue
            fns = _runnable(fns, f"{suite}/{tier}", out.skipped)
            if not fns:
                continue
            base = timing or TimingConfig(device=device)
            limit = TIER_LIMIT_S[tier] / (2 * len(fns))  # compare() may spend max_time_s per function
            res = compare(fns, dataclasses.replace(base, max_time_s=min(base.max_time_s, limit)))
        enough = min(base.min_iters, MIN_SAMPLES)  # a result file refuses cases with fewer
        for name, t in res.items():
            if len(t.samples) >= enough:
                out.timings[f"{suite}/{tier}/{name}"] = t
            else:
                out.skipped[f"{suite}/{tier}/{name}"] = (
                    f"only {len(t.samples)} samples within the tier's {TIER_LIMIT_S[tier]:g} s limit; expected at "
                    f"least {enough} (a smaller tier, or a faster device)")
    return out


def _runnable(fns: dict[str, Callable[[], Any]], prefix: str, skipped: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """The cases whose first call succeeds; the others go to ``skipped`` with their error."""
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
        except Exception as exc:
            skipped[f"{prefix}/{name}"] = f"raised on its first call: {type(exc).__name__}: {str(exc)[:200]}"
        else:
            ok[name] = fn
    return ok
