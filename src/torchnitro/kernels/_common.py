"""Input checks shared by the kernel modules (messages: what was received, what was expected, the fix)."""

from __future__ import annotations

from typing import Sequence

import torch

from torchnitro.errors import InputError, ShapeError

__all__ = ["check_float", "check_same_shape", "check_last_dim", "check_approximate", "check_qkv", "autocast_inputs",
           "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is None or isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES:
            continue
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{op}: {name} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dtype not in FLOAT_DTYPES:
            raise InputError(
                f"{op}: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16; cast it with .float()"
            )


def check_same_shape(op: str, names: Sequence[str], *tensors: torch.Tensor) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if any(s != shapes[0] for s in shapes):
        got = ", ".join(f"{n}={s}" for n, s in zip(names, shapes))
        raise ShapeError(f"{op}: received {got}; expected equal shapes; reshape the inputs to match")


def check_last_dim(op: str, name: str, t: torch.Tensor | None, size: int) -> None:
    if t is not None and (t.dim() != 1 or t.shape[0] != size):  # not tuple(t.shape): that costs microseconds
        raise ShapeError(
            f"{op}: {name} has shape {tuple(t.shape)}; expected ({size},) to match the input's last dim"
        )


def check_approximate(op: str, approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise InputError(f"{op}: approximate={approximate!r}; expected 'none' (exact erf) or 'tanh'")


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    """Attention inputs: q (B, H, Tq, D), k and v (B, Hkv, Tk, D) with H a multiple of Hkv >= 1;
    ``window`` None or a positive int."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected 4-d "
                         "(B, H, T, D) tensors; transpose (B, T, H, D) inputs with .transpose(1, 2)")
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or k.shape[1] < 1 or H % k.shape[1]:
        raise ShapeError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected k and v "
                         "of shape (B, Hkv, Tk, D) with H a multiple of Hkv")
    if window is not None and window < 1:
        raise InputError(f"{op}: window={window}; expected a positive int or None")


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Cast GEMM inputs as ``torch.autocast`` would cast them for ``F.linear`` (the fused GEMMs run
    outside autocast's dispatcher, so they apply its policy themselves). A no-op outside autocast."""
    first = next((t for t in tensors if t is not None), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dt = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dt) if t is not None and t.is_floating_point() else t for t in tensors)
