"""Triton plumbing shared by every kernel module: lazy JIT, the interpreter switch, launch sizes.

Triton decides at decoration time whether ``@triton.jit`` builds a GPU kernel or an interpreted
one (``TRITON_INTERPRET=1``). Kernels here are plain functions wrapped by :class:`LazyKernel`,
which jits them on first launch for the mode in force *then*, so importing torchnitro before a test
sets ``TRITON_INTERPRET`` does not freeze the wrong mode. ``@triton.autotune`` is bypassed while
interpreting (the interpreter cannot time configs): the first config is launched directly.

:func:`pick_config` chooses a kernel's launch config by measurement: a short explicit candidate list
is timed once per key (kernel, shape bucket, dtype, device) with CUDA events on the first call and
the winner cached in-process (:func:`tuned_configs` shows what was picked). On CPU, under the
interpreter, while a CUDA graph is being captured, or with ``TORCHNITRO_KERNEL_TUNE=0`` the first
candidate (the fixed default) is used and nothing is timed.

Host time matters: at 4096 x 4096 a norm kernel runs in tens of microseconds, about what the Python
around it costs, so the launchers keep a per-shape launch plan: a launcher looks its exact key up with
:func:`cached_plan` and only on a miss calls :func:`make_plan` (pick the config, build the plan, keep
it once final). Once a config is final, a call is one dict lookup, the allocations and the launch
(benchmarks/host_overhead.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Callable, Hashable, Sequence

__all__ = ["triton_importable", "interpreting", "getenv", "LazyKernel", "jit", "cdiv", "next_pow2", "num_programs",
           "row_config", "tuning_enabled", "cuda_ms", "pick_config", "tuned_configs", "clear_tuned_configs", "cached_plan",
           "make_plan", "store_plan", "TUNE_MIN_SIZE", "TUNE_MARGIN"]


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        _import_language()
    except Exception:
        return False
    return True


_ENV_DATA: Any = getattr(os.environ, "_data", None)  # CPython's raw mapping behind os.environ (encoded keys)
_ENV_KEYS: dict[str, Any] = {}
_ENV_VALUES: dict[Any, str] = {}  # raw -> decoded; bounded by the distinct values these few variables take
_TRUE = ("1", "true", "yes", "on")


def getenv(name: str) -> str | None:
    """``os.environ.get(name)`` for checks made on every launch, without the mapping's encode/decode
    round trip (a microsecond or more per read on a slow host). ``os.environ[...] = ...`` and
    ``del os.environ[...]`` (and pytest's monkeypatch) update the raw mapping, so this sees them; where
    that mapping is laid out differently it is the plain ``os.environ.get``."""
    encodekey = getattr(os.environ, "encodekey", None)
    decodevalue = getattr(os.environ, "decodevalue", None)
    if not isinstance(_ENV_DATA, dict) or encodekey is None or decodevalue is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = encodekey(name)
    raw = _ENV_DATA.get(key)
    if raw is None:
        return None
    value = _ENV_VALUES.get(raw)
    if value is None:
        value = _ENV_VALUES[raw] = decodevalue(raw)
    return value


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through the interpreter."""
    value = getenv("TRITON_INTERPRET")
    return value is not None and value.strip().lower() in _TRUE


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
        index = getattr(device, "index", None)
        return _sm_count(torch.cuda.current_device() if index is None else index)
    return cap


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:  # the device-property query costs microseconds on every call otherwise
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


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


def tuning_enabled(device: Any) -> bool:
    """Whether :func:`pick_config` may time candidates on ``device``: a CUDA device, not interpreting,
    ``TORCHNITRO_KERNEL_TUNE`` not set to 0, no CUDA graph capture in progress (it cannot sync) and no
    torch.compile trace (fake tensors cannot be timed)."""
    if (getenv("TORCHNITRO_KERNEL_TUNE") or "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if interpreting() or (getattr(device, "type", None) or str(device).split(":")[0]) != "cuda":
        return False
    import torch

    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
    return torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing() and not compiling()


_TUNED: dict[Hashable, dict[str, Any]] = {}  # key -> {"config": winner, "ms": {candidate: ms}}
_TUNE_LOCK = threading.RLock()


def cuda_ms(fn: Callable[[], Any], reps: int = 1) -> float:
    """Mean ms per call of ``reps`` back-to-back calls of ``fn``, between two CUDA events on the current
    stream (no warm-up: callers compile and warm up as they need)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _time_candidates(candidates: Sequence[dict[str, Any]], run: Callable[[dict[str, Any]], Any],
                     rounds: int = 3, budget_ms: float = 2.0) -> dict[int, float]:
    """Best-of-``rounds`` mean ms per call of each candidate that runs (index -> ms), timed with CUDA
    events around a burst of calls sized to ~``budget_ms``; a candidate that raises (fails to compile,
    out of resources) is left out."""
    import torch

    ok: dict[int, int] = {}  # index -> calls per burst
    for i, cfg in enumerate(candidates):
        try:
            run(cfg)  # compiles
            torch.cuda.synchronize()
            ok[i] = max(3, min(100, int(budget_ms / max(cuda_ms(lambda: run(cfg)), 1e-3))))
        except Exception:  # a config this device cannot build or launch is simply not a candidate
            continue
    best: dict[int, float] = {}
    for _ in range(rounds):  # rounds interleave candidates, so clock drift hits all alike
        for i, reps in list(ok.items()):
            try:
                ms = cuda_ms(lambda: run(candidates[i]), reps)
            except Exception:  # failed on a later launch: dropped like one that never built
                del ok[i]
                best.pop(i, None)
                continue
            best[i] = min(best.get(i, float("inf")), ms)
    return best


TUNE_MIN_SIZE = 1 << 20  # elements below which a launch is latency-bound: every config is alike, none timed
TUNE_MARGIN = 0.02  # another config must beat the default by this fraction to replace it


def pick_config(key: Hashable, candidates: Sequence[dict[str, Any]], run: Callable[[dict[str, Any]], Any],
                device: Any, size: int | None = None) -> dict[str, Any]:
    """The launch config to use for ``key`` (e.g. ``("layer_norm_fwd", C, rows_bucket, dtype, device)``).

    ``candidates`` are keyword dicts for ``run`` (which launches the kernel once with that config on the
    caller's real tensors; it must only write outputs the caller overwrites afterwards). The first
    candidate is the default: it is returned without timing when :func:`tuning_enabled` is False, when
    ``size`` (elements the launch touches) is below ``TUNE_MIN_SIZE``, and when every candidate fails.
    Otherwise all are timed once (:func:`_time_candidates`) and the fastest is cached under ``key`` for
    this process and returned; the default keeps its place unless another is over ``TUNE_MARGIN``
    faster (timing noise does not move the pick). Every candidate must compute the same result (tests
    launch each one), so the pick only changes speed.
    """
    if not candidates:
        from torchnitro.errors import InputError

        raise InputError("pick_config: received an empty candidate list; expected at least the default config")
    hit = _TUNED.get(key)
    if hit is not None:
        return hit["config"]
    if (size is not None and size < TUNE_MIN_SIZE) or not tuning_enabled(device):
        return candidates[0]
    with _TUNE_LOCK:
        hit = _TUNED.get(key)
        if hit is not None:
            return hit["config"]
        ms = _time_candidates(candidates, run)
        win = min(ms, key=ms.__getitem__) if ms else 0
        if 0 in ms and ms[0] <= ms[win] * (1 + TUNE_MARGIN):
            win = 0
        cfg = candidates[win]
        _TUNED[key] = {"config": dict(cfg), "ms": {_cfg_name(candidates[i]): round(t, 5) for i, t in ms.items()}}
        return _TUNED[key]["config"]


def _cfg_name(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


_PLANS: dict[Hashable, Any] = {}  # (op, exact sizes, dtype, device, flags, interpreting) -> a launcher's plan
_MAX_PLANS = 4096  # distinct shapes kept; past it the cache starts over (shapes that vary per step)


def cached_plan(key: Hashable, config: dict[str, Any] | None = None) -> Any:
    """The launch plan stored under ``key`` by :func:`store_plan`, or None; always None for a forced
    ``config`` (a launcher called with one builds its plan from it, see :func:`make_plan`)."""
    return _PLANS.get(key) if config is None else None


def make_plan(key: Hashable, config: dict[str, Any] | None, tune_key: Hashable,
              candidates: Sequence[dict[str, Any]], device: Any, size: int | None, *,
              build: Callable[[dict[str, Any]], Any], execute: Callable[[Any], Any]) -> Any:
    """The launch plan of a call :func:`cached_plan` had none for (launchers look up first, so a hit
    builds no tuning key, candidate list or closure).

    ``build(cfg)`` turns a launch config into a plan (launch callables, kwargs, grid, ...);
    ``execute(plan)`` launches a plan once on the call's real tensors. A forced ``config`` gives
    ``build(config)``, neither looked up nor kept. Otherwise :func:`pick_config` picks among
    ``candidates`` under ``tune_key`` (timing ``execute(build(cfg))``; ``size`` as there) and the plan
    of its pick is returned, kept under ``key`` by :func:`store_plan` when that config is final.
    """
    if config is not None:
        return build(config)
    cfg = pick_config(tune_key, candidates, lambda c: execute(build(c)), device, size)
    return store_plan(key, build(cfg), tune_key, device, size)


def store_plan(key: Hashable, plan: Any, tune_key: Hashable, device: Any, size: int | None) -> Any:
    """Keep ``plan`` (whatever a launcher needs to launch again: launch callables, kwargs, grid) under
    ``key`` once the config it was built from is final: measured and cached under ``tune_key`` by
    :func:`pick_config`, too small to be timed, or on a device that is never timed (CPU, interpreter).
    A default used only because timing was impossible then (CUDA graph capture, a torch.compile
    trace, ``TORCHNITRO_KERNEL_TUNE=0``) is not kept, so a later call can still measure. Returns ``plan``."""
    dev_type = getattr(device, "type", None) or str(device).split(":")[0]
    if tune_key in _TUNED or (size is not None and size < TUNE_MIN_SIZE) or dev_type != "cuda" or interpreting():
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def tuned_configs() -> dict[str, dict[str, Any]]:
    """What :func:`pick_config` chose in this process: ``str(key) -> {"config": ..., "ms": {candidate: ms}}``."""
    return {str(k): {"config": dict(v["config"]), "ms": dict(v["ms"])} for k, v in list(_TUNED.items())}


def clear_tuned_configs() -> None:
    """Forget every pick and launch plan (the next call of each kernel measures again)."""
    _TUNED.clear()
    _PLANS.clear()


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

    def _kernel(self, mode: bool | None = None) -> Any:
        if mode is None:
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
        """A launcher for ``grid`` in the mode in force now; it may be kept and called again (launch plans)."""
        mode = interpreting()
        kernel = self._kernel(mode)
        if not mode:
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

