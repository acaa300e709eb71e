"""Native varlen attention on the CPU: a small C kernel compiled here for this machine, called via ctypes.

torch has no varlen attention and no bf16-dot-product attention kernel of its own on the CPU. This
module compiles ``cpu_attention.c`` with the C compiler at hand (``gcc -O3 -march=native``: AVX512 FMA,
``_mm512_dpbf16_ps`` where the CPU has AVX512-BF16, a portable loop otherwise), caches the shared
library under ``$TORCHNITRO_CACHE_DIR/kernels`` (default ``~/.cache/torchnitro``) by a hash of the
source, the compiler, the flags and the CPU's flags, and calls it on tensor data pointers.

    out = varlen_attention(qkv, cu_seqlens, n_heads, compute="bf16")   # (N, 3D) -> (N, D)

Every sequence ``b`` (rows ``cu_seqlens[b]:cu_seqlens[b+1]`` of the packed ``qkv``) attends only to its
own rows: ``softmax(q k^T / sqrt(Dh)) v`` per head, as FlashAttention's varlen path does, with no
padding, mask or gather. Softmax is exact in fp32 (a full row of scores; vectorised exp2, ~1e-7
relative). ``compute="bf16"`` rounds q, k, v and the probabilities to bf16 and accumulates in fp32.
An additive bias (MPNet's relative positions) is not supported: callers keep SDPA for it.

Threads: OpenMP over (sequence, head) items, linked against torch's own libgomp (one OpenMP runtime
and one thread pool in the process), ``torch.get_num_threads()`` threads. Where torch bundles no
libgomp the kernel is built single-threaded.

Where no compiler is found or the build fails, ``cpu_attention_reason()`` says why in one line and
callers use SDPA; nothing here raises for a missing compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

__all__ = ["COMPILER", "NativeAttention", "cpu_attention_reason", "has_native_bf16", "kernel_name", "load_kernel",
           "load_native", "loaded_libgomp", "varlen_attention"]

COMPILER = os.environ.get("CC", "gcc")  # the C compiler; a test points it at a missing name to check the fallback
_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c11")
_SOURCE = Path(__file__).with_name("cpu_attention.c")
_ABI = 2  # tn_attn_abi() of the C source this loader speaks to
_CAP_OPENMP = 1  # tn_attn_caps() bit: built with OpenMP threads
_BUILD_TIMEOUT_S = 120.0


@dataclass
class _Kernel:
    lib: ctypes.CDLL
    caps: int
    path: Path


_lock = threading.Lock()
_state: dict[str, object] = {}  # "kernel": _Kernel, or "reason": str; keyed by COMPILER so a test may change it


def _cache_root() -> Path:
    env = os.environ.get("TORCHNITRO_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "torchnitro") / "kernels"


def _torch_libgomp() -> Path | None:
    """torch's bundled OpenMP runtime (the one its own parallel regions use), if it has one."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*")) if lib.is_dir() else []
    return found[0] if found else None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_id(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else cc


def _build(cc: str, source: Path = _SOURCE) -> Path:
    """The shared library for ``source`` (this module's kernel by default; ``cpu_int8`` builds its own the same
    way), this compiler, flags and CPU: from the cache, else compiled into it."""
    src = source.read_bytes()
    gomp = _torch_libgomp()
    key = hashlib.sha256(b"\0".join([src, _compiler_id(cc).encode(), " ".join(_FLAGS).encode(),
                                     _cpu_flags().encode(), str(gomp).encode()])).hexdigest()[:20]
    root = _cache_root()
    target = root / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        obj, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        omp = ["-fopenmp"] if gomp is not None else []
        # compile with OpenMP, link against torch's libgomp by path (not the compiler's -lgomp): one runtime
        steps = [[cc, *_FLAGS, *omp, "-c", str(source), "-o", str(obj)],
                 [cc, "-shared", str(obj), "-o", str(so)]
                 + ([str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else []) + ["-lm"]]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            if res.returncode != 0:
                err = (res.stderr or res.stdout).strip().splitlines()
                first = next((ln for ln in err if "error" in ln), err[0] if err else "")  # not "In function ...:"
                raise RuntimeError(f"{Path(cc).name} exited with {res.returncode}: {first.strip()}")
        os.replace(so, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _open(path: Path) -> _Kernel:
    lib = ctypes.CDLL(str(path))
    if lib.tn_attn_abi() != _ABI:
        raise RuntimeError(f"{path.name} speaks ABI {lib.tn_attn_abi()}, this loader {_ABI}")
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.tn_varlen_attention.argtypes = [ctypes.c_void_p, i64, i64, i32, ctypes.c_void_p, i64, i64, i64,
                                        ctypes.c_float, ctypes.c_void_p, i64, i32, i32, i32]
    lib.tn_varlen_attention.restype = i32
    lib.tn_attn_path.argtypes = [i32]
    return _Kernel(lib, int(lib.tn_attn_caps()), path)


def load_native(state: dict[str, object], source: Path, open_lib: Callable[[Path], object], what: str) -> object:
    """``open_lib`` of ``source``'s shared library (built on first use, then cached on disk and in ``state``), or
    None with ``state["reason"]`` saying why in one line ("``what`` unavailable: ..."). Rebuilt when COMPILER
    changes."""
    with _lock:
        key = COMPILER
        if state.get("compiler") != key:
            state.clear()
            state["compiler"] = key
            try:
                cc = shutil.which(key)
                if cc is None:
                    raise RuntimeError(f"no C compiler: {key!r} is not on PATH (set CC to one)")
                state["kernel"] = open_lib(_build(cc, source))
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                state["reason"] = f"{what} unavailable: {why}"
        return state.get("kernel")


def load_kernel() -> _Kernel | None:
    """The compiled kernel (built on first use, then cached on disk and in the process), or None: see
    ``cpu_attention_reason``."""
    return load_native(_state, _SOURCE, _open, "native attention")  # type: ignore[return-value]


def cpu_attention_reason() -> str | None:
    """None when the native kernel runs here, else why not (one line)."""
    if load_kernel() is None:
        return str(_state.get("reason"))
    return None


def kernel_name(compute: str = "bf16") -> str:
    """What ``compute`` runs as here: ``native avx512-bf16 varlen``, ``native avx512 fp32 varlen``,
    ``native portable fp32 varlen`` (bf16 emulated: ``native portable bf16-emulated varlen``)."""
    k = load_kernel()
    if k is None:
        return "none"
    path = k.lib.tn_attn_path(1 if compute == "bf16" else 0)
    name = {2: "avx512-bf16", 1: "avx512 fp32"}.get(path, "portable " + ("bf16-emulated" if compute == "bf16"
                                                                           else "fp32"))
    return f"native {name} varlen" + ("" if k.caps & _CAP_OPENMP else ", single-threaded")


def has_native_bf16() -> bool:
    """Whether ``compute="bf16"`` runs on bf16 dot-product instructions here (AVX512-BF16), not emulated."""
    k = load_kernel()
    return k is not None and k.lib.tn_attn_path(1) == 2


def loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (one expected: torch's)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-1] for ln in maps if "libgomp" in ln.rsplit("/", 1)[-1]})


def _check(qkv: Tensor, cu: Tensor, n_heads: int, compute: str, out_dtype: torch.dtype) -> int:
    """Validates the inputs; returns D."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 2:
        raise ValueError(f"varlen_attention: qkv must be a 2-D (N, 3D) tensor, received "
                         f"{tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}")
    if qkv.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"varlen_attention: qkv and out_dtype must be float32 or bfloat16, received {qkv.dtype} "
                         f"and {out_dtype}")
    if qkv.device.type != "cpu":
        raise ValueError(f"varlen_attention: qkv must be on the CPU, received {qkv.device}")
    if qkv.stride(1) != 1 or qkv.stride(0) < qkv.shape[1]:
        raise ValueError(f"varlen_attention: qkv rows must be contiguous (stride (>= {qkv.shape[1]}, 1)), received "
                         f"strides {tuple(qkv.stride())}; pass qkv.contiguous()")
    if compute not in ("fp32", "bf16"):
        raise ValueError(f"varlen_attention: compute must be 'fp32' or 'bf16', received {compute!r}")
    if not isinstance(n_heads, int) or n_heads < 1 or qkv.shape[1] % (3 * n_heads):
        raise ValueError(f"varlen_attention: qkv's width {qkv.shape[1]} must be 3 * n_heads * head_dim, received "
                         f"n_heads={n_heads!r}")
    if (not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64)
            or cu.device.type != "cpu"):
        raise ValueError("varlen_attention: cu_seqlens must be a 1-D int32/int64 CPU tensor of B + 1 row offsets, "
                         f"received {cu.dtype if isinstance(cu, Tensor) else type(cu).__name__} of shape "
                         f"{tuple(cu.shape) if isinstance(cu, Tensor) else '?'}")
    return qkv.shape[1] // 3  # cu_seqlens' values are checked by the kernel (_bad_offsets): no torch ops per call


def _bad_offsets(cu: Tensor, n: int) -> ValueError:
    vals = cu.tolist()
    down = next((i for i in range(1, len(vals)) if vals[i] < vals[i - 1]), None)
    return ValueError(f"varlen_attention: cu_seqlens must start at 0, never decrease and end at N = {n} (qkv's rows), "
                      f"received {vals[0]} .. {vals[-1]}" + (f", decreasing at index {down}" if down else ""))


def varlen_attention(qkv: Tensor, cu_seqlens: Tensor, n_heads: int, *, compute: str = "fp32",
                     out_dtype: torch.dtype | None = None, scale: float | None = None) -> Tensor:
    """``(N, 3D)`` packed q|k|v rows and ``(B + 1,)`` sequence offsets -> ``(N, D)`` attention output.

    Raises ``RuntimeError`` with ``cpu_attention_reason()`` when the kernel is not available here
    (callers that can fall back check ``cpu_attention_reason()`` first)."""
    out_dtype = qkv.dtype if out_dtype is None else out_dtype
    d = _check(qkv, cu_seqlens, n_heads, compute, out_dtype)
    k = load_kernel()
    if k is None:
        raise RuntimeError(str(_state.get("reason")))
    out = torch.empty(qkv.shape[0], d, dtype=out_dtype)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 and cu_seqlens.is_contiguous() else (
        cu_seqlens.to(torch.int64).contiguous())
    dh = d // n_heads
    rc = k.lib.tn_varlen_attention(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), int(qkv.dtype == torch.bfloat16),
                                   cu.data_ptr(), cu.numel() - 1, n_heads, dh,
                                   1.0 / math.sqrt(dh) if scale is None else scale, out.data_ptr(), d,
                                   int(out_dtype == torch.bfloat16), int(compute == "bf16"), torch.get_num_threads())
    if rc == -2:
        raise _bad_offsets(cu, qkv.shape[0])
    if rc != 0:
        raise MemoryError("varlen_attention: the kernel could not allocate its work buffers")
    return out


class NativeAttention:
    """A layer's native attention setting (``compute``: "fp32" or "bf16"); a plain object, so it deep-copies
    and pickles with the layer. ``(qkv, cu_seqlens, n_heads, out_dtype) -> (N, D)``."""

    def __init__(self, compute: str):
        if compute not in ("fp32", "bf16"):
            raise ValueError(f"NativeAttention: compute must be 'fp32' or 'bf16', received {compute!r}")
        self.compute = compute

    def __call__(self, qkv: Tensor, cu_seqlens: Tensor, n_heads: int, out_dtype: torch.dtype | None = None) -> Tensor:
        return varlen_attention(qkv, cu_seqlens, n_heads, compute=self.compute, out_dtype=out_dtype)

    def __repr__(self) -> str:
        return f"NativeAttention(compute={self.compute!r})"
