"""Instruction counts of a Triton kernel's machine code, compiled for a GPU that need not be present.

    python benchmarks/kernel_sass.py                       # hrr's FFT bind kernel, sm_90 (H100)
    python benchmarks/kernel_sass.py --dims 1024 --launch 1x1 2x4 --arch 90
    python benchmarks/kernel_sass.py --kernel old_fft_kernel.py   # another version of hrr/fft_kernel.py
    python benchmarks/kernel_sass.py --cuda --dims 256 1024 4096  # the CUDA C++ kernel (hrr/cuda_fft.py)

Compiles ``_fft_bind_kernel`` ahead of time with Triton's bundled ``ptxas`` and disassembles it
with its bundled ``cuobjdump`` (no GPU, no CUDA toolkit), then counts SASS instructions by opcode.
The kernel is fully unrolled, so the static count per thread is also the dynamic count; times the
threads of a program and divided by its rows it gives instructions issued per row, which with the
GPU's issue rate bounds the kernel's time from below. Columns: floating-point arithmetic, the
exchanges between threads (warp shuffles plus their selects, shared-memory stores/loads, barriers),
registers per thread and spills. Writes results/kernel_sass.{json,md}.

``--cuda`` counts the CUDA C++ kernel of ``hrr/cuda_fft.py`` instead, at its default launch: built to a
cubin with NVRTC (``pip install nvidia-cuda-nvrtc``, or ``TORCHNITRO_NVRTC=/path/libnvrtc.so``) and
disassembled with Triton's bundled ``cuobjdump``.

Used to pick between FFT formulations before spending GPU time: see docs/hrr.md ("The one-pass FFT
kernel"). The counts are for the Triton version installed here; the GPU image may run another.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchnitro.bench import ResultTable

_OPCODE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _load_kernel(path: str | None):
    """``_fft_bind_kernel`` of ``path`` (default: torchnitro's), jitted for compilation only."""
    from torchnitro.kernels._triton import jit  # makes ``tl`` visible to the kernel body, as LazyKernel does

    if path is None:
        from torchnitro.hrr import fft_kernel as mod
    else:
        spec = importlib.util.spec_from_file_location("fft_kernel_under_test", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return jit(mod._fft_bind_kernel)


def _sass_counts(kernel, d: int, rows: int, warps: int, conj_b: bool, arch: int, workdir: Path,
                 normalize: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    known = {"N": d, "LOGN": d.bit_length() - 1, "CONJ_B": conj_b, "R": rows, "NORMALIZE": normalize}
    consts = {name: known[name] for name in kernel.arg_names if name in known}  # older versions lack some
    sig = {name: "constexpr" if name in consts else "*fp32" if name.endswith("_ptr") else
           "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    cubin = workdir / f"k_{d}_{rows}_{warps}_{int(conj_b)}_{int(normalize)}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return _disassemble(cubin)


def _disassemble(cubin: Path) -> dict:
    """Opcode counts and registers of a cubin, read with Triton's bundled cuobjdump."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    ops = collections.Counter(m.group(1) for line in sass.splitlines() if (m := _OPCODE.match(line)))
    regs = re.search(r"REG:(\d+)", usage)
    return {"ops": ops, "total": sum(ops.values()), "regs": int(regs.group(1)) if regs else None}


@functools.lru_cache(maxsize=1)
def _nvrtc():
    """libnvrtc through ctypes: $TORCHNITRO_NVRTC, the nvidia-cuda-nvrtc wheel, or the system's."""
    import ctypes
    import ctypes.util
    import glob

    cands = [os.environ.get("TORCHNITRO_NVRTC", "")]
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    cands.append(ctypes.util.find_library("nvrtc") or "")
    for c in cands:
        if c and "builtins" not in c:
            try:
                return ctypes.CDLL(c)
            except OSError:
                continue
    raise RuntimeError("no libnvrtc found (pip install nvidia-cuda-nvrtc, or set TORCHNITRO_NVRTC)")


def _cuda_sass_counts(d: int, conj_b: bool, normalize: bool, arch: int, workdir: Path) -> dict:
    import ctypes

    from torchnitro.hrr.cuda_fft import kernel_source

    src, name, threads, rows = kernel_source(d, conj_b, normalize)
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"hrr_bind.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"-std=c++17", f"-arch=sm_{arch}".encode()]
    t0 = time.perf_counter()
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    build_s = time.perf_counter() - t0
    size = ctypes.c_size_t()
    if rc != 0:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed to build {name}: {log.value.decode(errors='replace')}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    cubin = workdir / f"{name}.cubin"
    cubin.write_bytes(buf.raw)
    return {**_disassemble(cubin), "threads": threads, "rows": rows, "build_s": build_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", help="a fft_kernel.py to analyse instead of torchnitro's")
    ap.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--launch", nargs="+", default=["1x1", "1x2", "2x4", "1x4"],
                    help="ROWSxWARPS launch configurations")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80 (A100)")
    ap.add_argument("--unbind", action="store_true", help="count the unbinding variant (reversed load of b)")
    ap.add_argument("--normalize", action="store_true", help="count the bind_normalize epilogue variant")
    ap.add_argument("--cuda", action="store_true", help="count hrr/cuda_fft.py's CUDA C++ kernel (NVRTC)")
    ap.add_argument("--name", default="kernel_sass")
    args = ap.parse_args()
    if args.cuda:
        return _main_cuda(args)
    try:
        import triton
        kernel = _load_kernel(args.kernel)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this tool is optional
        print(f"kernel_sass.py needs Triton with its bundled ptxas/cuobjdump: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, set to silence its notice
    t = ResultTable(f"SASS instruction counts, sm_{args.arch}, Triton {triton.__version__}",
                    ["d", "rows", "warps", "instr_per_thread", "instr_per_row", "fp_arith", "exchange", "barriers",
                     "regs", "spills"],
                    meta={"command": "python benchmarks/kernel_sass.py " + " ".join(sys.argv[1:]),
                          "kernel": args.kernel or "torchnitro.hrr.fft_kernel", "triton": triton.__version__,
                          "fp_arith": "FADD + FMUL + FFMA", "exchange": "SHFL + FSEL + STS + LDS",
                          "instr_per_row": "instr_per_thread x 32 x warps / rows"})
    workdir = Path(tempfile.mkdtemp(prefix="kernel_sass_"))
    for d in args.dims:
        for launch in args.launch:
            rows, warps = (int(v) for v in launch.lower().split("x"))
            c = _sass_counts(kernel, d, rows, warps, args.unbind, args.arch, workdir, args.normalize)
            ops = c["ops"]
            t.add(d=d, rows=rows, warps=warps, instr_per_thread=c["total"],
                  instr_per_row=c["total"] * 32 * warps // rows,
                  fp_arith=ops["FADD"] + ops["FMUL"] + ops["FFMA"],
                  exchange=ops["SHFL"] + ops["FSEL"] + ops["STS"] + ops["LDS"], barriers=ops["BAR"],
                  regs=c["regs"], spills=ops["STL"] + ops["LDL"])
    t.print()
    t.save(args.name)
    return 0


def _main_cuda(args) -> int:
    try:
        _nvrtc()
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("Triton is not installed (its bundled cuobjdump disassembles the cubin)")
    except Exception as exc:  # noqa: BLE001 - reported, not raised: this tool is optional
        print(f"kernel_sass.py --cuda needs NVRTC and Triton's cuobjdump: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    t = ResultTable(f"SASS instruction counts, sm_{args.arch}, hrr.cuda_fft (NVRTC)",
                    ["d", "rows", "threads", "instr_per_thread", "instr_per_row", "fp_arith", "exchange", "barriers",
                     "regs", "spills", "nvrtc_build_s"],
                    meta={"command": "python benchmarks/kernel_sass.py " + " ".join(sys.argv[1:]),
                          "kernel": "torchnitro.hrr.cuda_fft", "cpu": platform.processor() or platform.machine(),
                          "nvrtc_build_s": "nvrtcCompileProgram to a cubin on this machine's CPU (what a first "
                                           "call costs per kernel variant, before the driver loads it)", "fp_arith": "FADD + FMUL + FFMA",
                          "exchange": "SHFL + FSEL + STS + LDS", "instr_per_row": "instr_per_thread x threads / rows"})
    workdir = Path(tempfile.mkdtemp(prefix="kernel_sass_"))
    for d in args.dims:
        c = _cuda_sass_counts(d, args.unbind, args.normalize, args.arch, workdir)
        ops = c["ops"]
        t.add(d=d, rows=c["rows"], threads=c["threads"], instr_per_thread=c["total"],
              instr_per_row=c["total"] * c["threads"] // c["rows"], fp_arith=ops["FADD"] + ops["FMUL"] + ops["FFMA"],
              exchange=ops["SHFL"] + ops["FSEL"] + ops["STS"] + ops["LDS"], barriers=ops["BAR"] + ops["WARPSYNC"],
              regs=c["regs"], spills=ops["STL"] + ops["LDL"], nvrtc_build_s=c["build_s"])
    t.print()
    t.save(args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
