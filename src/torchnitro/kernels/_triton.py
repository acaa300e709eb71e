"""Triton plumbing shared by every kernel module: lazy JIT, the interpreter switch, launch sizes.

Triton decides at decoration time whether ``@triton.jit`` builds a GPU kernel or an interpreted
one (``TRITON_INTERPRET=1``). Kernels here are plain functions wrapped by :class:`LazyKernel`,
which jits them on first launch for the mode in force *then*, so importing torchnitro before a test
sets ``TRITON_INTERPRET`` does not freeze the wrong mode. ``@triton.autotune`` is bypassed while
interpreting (the interpreter cannot time configs): the first config is launched directly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable

__all__ = ["triton_importable", "interpreting", "LazyKernel", "jit", "cdiv", "next_pow2", "num_programs",
           "row_config"]


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        _import_language()
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _import_language() -> Any:
    """``triton.language``, imported in compiled mode even while ``TRITON_INTERPRET=1`` is set.

    Triton builds its own ``@jit`` helpers (``tl.sum``, ...) for the mode in force at import. Building
    them compiled keeps GPU launches working in a process that also interprets (the interpreter
    gets interpreted twins per launch, see ``_interpretable_stdlib``).
    """
    if "triton.language" not in sys.modules:
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            import triton.language  # noqa: F401
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
    return sys.modules["triton.language"]


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)`` after making ``tl`` visible to the kernel body (kernel modules do not import
    triton at import time)."""
    tl = _import_language()
    import triton

    fn.__globals__.setdefault("tl", tl)
    fn.__globals__.setdefault("constexpr", tl.constexpr)
    return triton.jit(fn)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_programs(device: Any, cap: int = 8) -> int:
    """How many persistent programs a reduction-over-rows backward uses (one per SM on CUDA)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cap


def row_config(n_cols: int, elem_size: int = 4) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that keeps one row of ``n_cols`` in registers (Liger's rule)."""
    block = next_pow2(n_cols)
    if block * elem_size > 65536 * 4:
        from torchnitro.errors import InputError

        raise InputError(
            f"row of {n_cols} elements is too long for a one-block row kernel; expected <= 65536 "
            "elements; use the reference backend (TORCHNITRO_KERNELS=reference) for this shape"
        )
    warps = 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32
    return block, warps


_STDLIB_CACHE: dict[int, Any] = {}


@contextlib.contextmanager
def _interpretable_stdlib():
    """Make triton's own ``@jit`` helpers (``tl.sum``, ``tl.max``, ``tl.sigmoid``, ...) interpretable.

    Triton builds them when ``triton.language`` is first imported, in the mode of that moment. If
    that was without ``TRITON_INTERPRET`` they are compiled-mode functions the interpreter refuses
    to call, so for the duration of an interpreted launch they are swapped for interpreted twins
    (restored afterwards, so compiled launches in the same process are unaffected).
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: list[tuple[Any, str, Any]] = []
    mods = {id(m): m for m in (tl, tl.standard, tl.math, tl.core, getattr(tl, "extra", None)) if m is not None}
    try:
        for mod in mods.values():
            for name, val in list(vars(mod).items()):
                if isinstance(val, JITFunction):
                    twin = _STDLIB_CACHE.get(id(val))
                    if twin is None:
                        twin = _STDLIB_CACHE[id(val)] = InterpretedFunction(val.fn)
                    swapped.append((mod, name, val))
                    setattr(mod, name, twin)
        yield
    finally:
        for mod, name, val in reversed(swapped):
            setattr(mod, name, val)


class LazyKernel:
    """A Triton kernel jitted on first launch, per interpreter mode.

    ``configs`` (a function returning ``triton.Config`` objects) with ``key`` turns on
    ``@triton.autotune`` on GPU;
    when interpreting, ``interpret_kwargs`` (default ``configs[0]``) is applied directly instead.
    """

    def __init__(self, fn: Callable[..., Any], configs: Callable[[], list[Any]] | None = None,
                 key: list[str] | None = None,
                 reset_to_zero: list[str] | None = None, interpret_kwargs: dict[str, Any] | None = None):
        self.fn = fn
        self.interpret_kwargs = interpret_kwargs
        self.configs = configs
        self.key = key or []
        self.reset_to_zero = reset_to_zero
        self._built: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def _kernel(self) -> Any:
        mode = interpreting()
        k = self._built.get(mode)
        if k is None:
            import triton

            k = jit(self.fn)
            if self.configs and not mode:
                k = triton.autotune(configs=self.configs(), key=self.key, reset_to_zero=self.reset_to_zero)(k)
            self._built[mode] = k
        return k

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        kernel = self._kernel()
        if not interpreting():
            return kernel[grid]
        fixed = (self.interpret_kwargs if self.interpret_kwargs is not None else self.configs()[0].kwargs) \
            if self.configs else {}

        def launch(*args: Any, **kwargs: Any) -> Any:
            extra = dict(fixed)
            extra.update(kwargs)
            g = grid(extra) if callable(grid) else grid
            with _interpretable_stdlib():
                return kernel[g](*args, **extra)

        return launch
