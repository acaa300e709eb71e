"""Backend selection for every fused op: Triton on CUDA when triton imports, else the reference.

``TORCHNITRO_KERNELS`` overrides the choice:

- unset or ``auto``: Triton for CUDA tensors when triton imports; otherwise the PyTorch reference.
  An auto-selected Triton that cannot run (triton missing on a GPU box) falls back with one warning.
- ``reference``: always the plain PyTorch version in ``kernels/reference.py``.
- ``triton``: always Triton; raises :class:`BackendUnavailableError` when it cannot run.

CPU tensors can run the Triton kernels only through the interpreter (``TRITON_INTERPRET=1``); that
is how the test suite checks the kernels on machines without a GPU.
"""

from __future__ import annotations

import warnings

import torch

from torchnitro.errors import BackendUnavailableError, ConfigError
from torchnitro.kernels._triton import getenv, interpreting, triton_importable

__all__ = ["BACKENDS", "MAX_ROW_COLS", "requested_backend", "select_backend", "use_triton", "use_triton_rows",
           "backend_report"]

MAX_ROW_COLS = 65536  # row kernels keep a whole row in registers; longer rows use the reference

BACKENDS = ("auto", "reference", "triton")
_warned: set[str] = set()


def requested_backend() -> str:
    """The value of ``TORCHNITRO_KERNELS`` (``auto`` when unset), validated."""
    raw = getenv("TORCHNITRO_KERNELS")  # read on every op call: the cheap read, then a memo of the parse
    hit = _PARSED.get(raw)
    if hit is not None:
        return hit
    value = (raw or "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ConfigError(
            f"TORCHNITRO_KERNELS={value!r} is not a known backend; expected one of {list(BACKENDS)}; "
            "unset it to let torchnitro choose"
        )
    _PARSED[raw] = value
    return value


_PARSED: dict[str | None, str] = {}  # raw TORCHNITRO_KERNELS value -> validated backend


def _triton_blocker(device: torch.device) -> str | None:
    """None when Triton can run on ``device`` here, else why not."""
    if not triton_importable():
        return "the 'triton' package does not import (pip install 'torchnitro[gpu]')"
    if device.type == "cuda":
        return None
    if interpreting() and device.type == "cpu":
        return None
    return f"Triton kernels need CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 to interpret them on CPU"


def select_backend(*tensors: torch.Tensor | None, op: str = "op") -> str:
    """``'triton'`` or ``'reference'`` for an op whose inputs are ``tensors``."""
    req = requested_backend()
    if req == "reference":
        return "reference"
    dev = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
    blocker = _triton_blocker(dev)
    if req == "triton":
        if blocker is not None:
            raise BackendUnavailableError(
                f"{op}: TORCHNITRO_KERNELS=triton was requested but {blocker}; expected a CUDA tensor "
                "and an importable triton; unset TORCHNITRO_KERNELS or set it to 'reference'"
            )
        return "triton"
    if blocker is None:
        return "triton"
    if dev.type == "cuda" and "triton" not in _warned:  # auto wanted Triton on a GPU but cannot have it
        _warned.add("triton")
        warnings.warn(f"torchnitro kernels: falling back to the PyTorch reference because {blocker}", stacklevel=3)
    return "reference"


def use_triton(*tensors: torch.Tensor | None, op: str = "op") -> bool:
    if tensors and _fast_triton(tensors[0]):
        return True
    return select_backend(*tensors, op=op) == "triton"


_TRITON_DEVICES = ("cuda",)  # device types on which the fast check picks Triton


def _fast_triton(x: torch.Tensor | None) -> bool:
    """The common case in a few attribute lookups: a CUDA tensor, no reference forced, triton imports
    (anything else takes ``select_backend``, which warns or raises as documented)."""
    return (isinstance(x, torch.Tensor) and x.device.type in _TRITON_DEVICES and requested_backend() != "reference"
            and triton_importable())


def use_triton_rows(x: torch.Tensor, n_cols: int, op: str) -> bool:
    """``use_triton`` for one-row-per-program kernels, which handle rows up to ``MAX_ROW_COLS``."""
    if n_cols <= MAX_ROW_COLS and _fast_triton(x):
        return True
    if not use_triton(x, op=op):
        return False
    if n_cols <= MAX_ROW_COLS:
        return True
    why = f"{op}: rows of {n_cols} columns exceed the row kernel's limit of {MAX_ROW_COLS}"
    if requested_backend() == "triton":
        raise BackendUnavailableError(f"{why}; expected at most {MAX_ROW_COLS}; unset TORCHNITRO_KERNELS to use the "
                                      "PyTorch reference for this shape")
    if op not in _warned:
        _warned.add(op)
        warnings.warn(f"{why}; using the PyTorch reference", stacklevel=3)
    return False


def backend_report() -> dict[str, object]:
    """What the dispatcher would do on this machine (for ``torchnitro doctor``-style output)."""
    return {
        "requested": requested_backend(),
        "triton_importable": triton_importable(),
        "cuda": torch.cuda.is_available(),
        "interpreting": interpreting(),
    }
