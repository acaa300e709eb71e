"""``Float8Linear``: a linear layer whose matmuls run in FP8 (e4m3 forward, e5m2 gradients).

Forward ``y = x @ W^T``: x and W are cast to e4m3 with their own scales. Backward: the output
gradient is cast to e5m2; ``dX = dY @ W`` and ``dW = dY^T @ X`` reuse the fp8 copies of X and W.

Backends:

- ``scaled_mm``: ``torch._scaled_mm`` on FP8 tensor cores (CUDA capability >= 8.9: Ada, Hopper).
  It wants the second operand column-major and every dimension a multiple of 16; scales passed are
  the inverse (dequantisation) scales. Accumulation is fp32, the output is the input's dtype.
- ``emulated``: quantise-dequantise then a regular matmul. Same rounding of the operands as the
  hardware path (the products are exact in fp32 either way), so it is how the numerics are tested on
  CPU; it is not faster.
- ``torchao``: ``torchao.float8.convert_to_float8_training`` where torchao is installed and the GPU
  supports it, offered for side-by-side comparison.

``to_float8_(model, scaling="dynamic" | "delayed")`` swaps ``nn.Linear`` modules in place (sharing
the weight ``Parameter``, so optimizers and tied weights keep working).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor, nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.kernels.dispatch import use_triton
from torchnitro.kernels.fp8 import _fp8_native, fp8_recipe_cast
from torchnitro.precision.fp8 import E4M3, E5M2, Float8Config, ScaleState, cast_to_fp8, fp8_max

__all__ = ["Float8Linear", "to_float8_", "fp8_matmul_supported", "scaled_mm_available"]

_warned: set[str] = set()


def scaled_mm_available(device: torch.device | str | None = None) -> bool:
    """True when ``torch._scaled_mm`` can run fp8 here (CUDA capability >= 8.9)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


@torch.compiler.assume_constant_result
def _scaled_mm_ok(device: torch.device) -> bool:
    """``scaled_mm_available`` as a constant for Dynamo: the device query is not traced (a fixed fact
    of the machine), so choosing the backend inside a compiled region costs no guard or graph break."""
    return scaled_mm_available(device)


def fp8_matmul_supported(m: int, k: int, n: int) -> bool:
    """``_scaled_mm`` shape rule: every dimension a multiple of 16."""
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0


def _col_major(t: Tensor) -> Tensor:
    return t.t().contiguous().t()


def _dynamic_cast(x: Tensor, dtype: torch.dtype, margin: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, scale, inv_scale)`` from ``x``'s own amax, in plain torch ops only.

    This is the path taken under ``torch.compile``: amax, scale, clamp and the fp8 conversion are
    ordinary aten ops, so Inductor fuses them into one reduction and one pointwise kernel around
    ``torch._scaled_mm``, with no host sync and no graph break (no ``.item()``, no Python branch on
    a tensor value, no opaque Triton launch). amax == 0 gives scale 1 and a non-finite amax gives
    scale 1 (the eager path keeps the previous scale instead; the compiled path holds no state).
    """
    amax = x.detach().abs().amax().float()
    ok = (amax > 0) & torch.isfinite(amax)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    scale = torch.where(ok, fp8_max(dtype) / safe / (2.0 ** margin), torch.ones_like(amax))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)  # a subnormal amax must not give an inf scale
    m = fp8_max(dtype)
    q = (x.float() * scale).clamp(-m, m).to(dtype)
    return q, scale, scale.reciprocal()


def _quantize(state: ScaleState, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, scale, inv_scale)`` of ``x`` under ``state``'s recipe.

    Dynamic scaling under ``torch.compile``: ``_dynamic_cast`` (plain ops Inductor fuses; the
    state is left as is, since a traced region cannot mutate it). Dynamic scaling in eager where the
    fused Triton cast runs (CUDA; CPU under ``TRITON_INTERPRET=1``): two passes over ``x`` and no
    host sync. Otherwise the PyTorch path of ``torchnitro.precision.fp8``, which records the scale.
    """
    if state.config.scaling == "dynamic":
        if torch.compiler.is_compiling():
            return _dynamic_cast(x, dtype, state.config.margin)
        if _fp8_native(x) and use_triton(x, op="fp8_recipe_cast"):
            state.sync_device(x.device)
            q, scale, inv, _ = fp8_recipe_cast(x, state.scale, dtype, state.config.margin)
            state.scale = scale
            return q, scale, inv
    scale = state.scale_for(x)
    return cast_to_fp8(x, scale, dtype), scale, scale.reciprocal()


def _mm(a_q: Tensor, a: tuple[Tensor, Tensor], b_q: Tensor, b: tuple[Tensor, Tensor], out_dtype: torch.dtype,
        hw: bool, bias: Tensor | None = None, fast_accum: bool = False) -> Tensor:
    """``(a_q / a_scale) @ (b_q / b_scale) [+ bias]`` for 2-D fp8 operands; ``a``/``b`` are (scale, inv_scale).

    ``fast_accum``: Hopper's fp8 fast accumulation (partial sums promoted to fp32 less often). Used
    for the forward output only, as torchao's float8 training does; the gradients keep full
    accumulation, where the sums over many tokens are longest."""
    if hw:
        fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
        out = torch._scaled_mm(a_q.contiguous(), _col_major(b_q), scale_a=a[1], scale_b=b[1],
                               bias=bias if fused_bias else None, out_dtype=out_dtype, use_fast_accum=fast_accum)
        out = out[0] if isinstance(out, tuple) else out
        return out + bias.to(out_dtype) if bias is not None and not fused_bias else out
    out = ((a_q.float() / a[0]) @ (b_q.float() / b[0])).to(out_dtype)
    return out + bias.to(out_dtype) if bias is not None else out


class _Float8MatmulFn(torch.autograd.Function):
    """fp8 ``x @ W^T + b``. Non-tensor arguments are plain constants (a bool, the ScaleStates) so
    that Dynamo traces forward and backward into the graph instead of breaking around them."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, states: tuple[ScaleState, ...],
                hw: bool) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        xq, sx, ix = _quantize(states[0], x2, E4M3)
        wq, sw, iw = _quantize(states[1], weight, E4M3)  # (N, K)
        y = _mm(xq, (sx, ix), wq.t(), (sw, iw), x.dtype, hw, bias, fast_accum=True)  # (M, N)
        ctx.save_for_backward(xq, wq, sx, ix, sw, iw)
        ctx.states, ctx.hw, ctx.x_shape = states, hw, x.shape
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        xq, wq, sx, ix, sw, iw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        gq, sg, ig = _quantize(ctx.states[2], g2, E5M2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _mm(gq, (sg, ig), wq, (sw, iw), ctx.dtypes[0], ctx.hw).reshape(ctx.x_shape)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            dw = _mm(gq.t(), (sg, ig), xq, (sx, ix), ctx.dtypes[1], ctx.hw)  # (N, M) @ (M, K)
        if ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(ctx.dtypes[2])  # bias gradient in high precision
        return dx, dw, db, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` with fp8 matmuls; construct directly or with ``Float8Linear.from_linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: Float8Config | None = None, device: Any = None, dtype: Any = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config or Float8Config()
        dev = self.weight.device
        self.scale_x = ScaleState(E4M3, self.config, dev)
        self.scale_w = ScaleState(E4M3, self.config, dev)
        self.scale_g = ScaleState(E5M2, self.config, dev)
        if self.config.backend == "scaled_mm" and not scaled_mm_available(dev if dev.type == "cuda" else None):
            raise BackendUnavailableError(
                "Float8Linear backend 'scaled_mm' needs a CUDA GPU with capability >= 8.9 (Ada/Hopper); "
                f"this machine has {'no CUDA GPU' if not torch.cuda.is_available() else torch.cuda.get_device_name()}. "
                "Use backend='auto' or 'emulated'.")

    @classmethod
    def from_linear(cls, lin: nn.Linear, config: Float8Config | None = None) -> "Float8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias  # share Parameters: optimizers and ties keep working
        new.config = config or Float8Config()
        dev = lin.weight.device
        new.scale_x = ScaleState(E4M3, new.config, dev)
        new.scale_w = ScaleState(E4M3, new.config, dev)
        new.scale_g = ScaleState(E5M2, new.config, dev)
        return new

    def _use_hw(self, m: int, k: int, n: int, device: torch.device) -> bool:
        backend = self.config.backend
        if backend == "emulated":
            return False
        ok = _scaled_mm_ok(device) and fp8_matmul_supported(m, k, n)
        if backend == "scaled_mm" and not ok:
            raise BackendUnavailableError(
                f"Float8Linear: scaled_mm cannot run shape (M={m}, K={k}, N={n}) on {device}; expected a "
                "CUDA capability >= 8.9 GPU and dimensions that are multiples of 16. Pad, or use backend='auto'.")
        if not ok and device.type == "cuda" and "shape" not in _warned and not torch.compiler.is_compiling():
            _warned.add("shape")
            warnings.warn("Float8Linear: falling back to the emulated fp8 path (GPU without fp8 matmul, or a "
                          "dimension not a multiple of 16)", stacklevel=3)
        return ok

    def forward(self, x: Tensor) -> Tensor:
        x_rows = x.numel() // x.shape[-1] if x.dim() else 0
        hw = self._use_hw(x_rows, x.shape[-1], self.weight.shape[0], x.device)
        return _Float8MatmulFn.apply(x, self.weight, self.bias, (self.scale_x, self.scale_w, self.scale_g), hw)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.config.scaling}, backend={self.config.backend}"


def _torchao_convert(model: nn.Module, config: Float8Config, module_filter: Callable[[nn.Module, str], bool]) -> nn.Module:
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise BackendUnavailableError("backend='torchao' needs torchao (pip install torchao); it is not "
                                      "installed. Use backend='auto'.") from exc
    if not scaled_mm_available():
        raise BackendUnavailableError("backend='torchao' float8 training needs a CUDA GPU with capability >= 8.9")
    if config.scaling != "dynamic":
        raise BackendUnavailableError("torchao float8 training here supports scaling='dynamic' only")
    return convert_to_float8_training(model, module_filter_fn=module_filter)


def to_float8_(model: nn.Module, scaling: str = "dynamic", *, config: Float8Config | None = None,
               skip: tuple[str, ...] = ("lm_head",),
               module_filter: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap ``nn.Linear`` modules of ``model`` for ``Float8Linear`` in place; returns ``model``.

    Modules whose qualified name ends with an entry of ``skip`` stay in high precision (the output
    head is the usual one). ``module_filter(module, fqn) -> bool`` overrides the choice.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"to_float8_: received {type(model).__name__}, expected an nn.Module")
    cfg = config or Float8Config(scaling=scaling)

    def keep(mod: nn.Module, fqn: str) -> bool:
        if module_filter is not None:
            return bool(module_filter(mod, fqn))
        return isinstance(mod, nn.Linear) and not any(fqn == s or fqn.endswith("." + s) for s in skip)

    if cfg.backend == "torchao":
        return _torchao_convert(model, cfg, keep)
    swaps = [(fqn, m) for fqn, m in model.named_modules()
             if isinstance(m, nn.Linear) and not isinstance(m, Float8Linear) and keep(m, fqn)]
    for fqn, m in swaps:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear.from_linear(m, cfg))
    if isinstance(model, nn.Linear) and not isinstance(model, Float8Linear) and keep(model, ""):
        raise InputError("to_float8_: the model itself is an nn.Linear; wrap it, or use Float8Linear.from_linear")
    return model

