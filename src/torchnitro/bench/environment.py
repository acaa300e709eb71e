"""The process settings a CPU timing depends on, recorded beside every result.

The C allocator's history moves eager latency (issue 14: MobileNetV3 138 ms with glibc's defaults,
66.5 ms with ``MALLOC_MMAP_THRESHOLD_=268435456``), and thread variables decide how many cores each
runtime takes; a number means little without the settings it was measured under.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = ["timing_environment", "describe_environment"]

_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ORT_", "OV_")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def _loaded_allocators() -> list[str]:
    """Non-default allocators mapped into this process (LD_PRELOAD or linked), from /proc/self/maps."""
    maps = Path("/proc/self/maps")
    text = maps.read_text(errors="replace") if maps.exists() else os.environ.get("LD_PRELOAD", "")
    return sorted({a for a in _ALLOCATORS if a in text})


def timing_environment() -> dict[str, str]:
    """Allocator, allocator/thread environment variables and torch's thread counts of this process."""
    libc, ver = platform.libc_ver()
    default = f"{libc} {ver} malloc".strip() if libc else "system malloc"
    env = {"allocator": ", ".join(_loaded_allocators()) or default}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(_PREFIXES)})
    if os.environ.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    env["torch_threads"] = str(torch.get_num_threads())
    env["torch_interop_threads"] = str(torch.get_num_interop_threads())
    return env


def describe_environment(env: dict[str, str] | None = None) -> str:
    """One line for a report: ``allocator glibc 2.36 malloc (default thresholds), torch threads 2, ...``."""
    env = dict(env if env is not None else timing_environment())
    alloc = env.pop("allocator")
    if not any(k.startswith("MALLOC_") for k in env) and "malloc" in alloc:
        alloc += " (default thresholds)"
    threads = f"torch threads {env.pop('torch_threads')} (inter-op {env.pop('torch_interop_threads')})"
    return ", ".join([f"allocator {alloc}", threads] + [f"{k}={v}" for k, v in env.items()])
