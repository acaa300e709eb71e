"""Where a result came from: the command, the machine and the library versions, for every results file.

A number in ``results/`` is only evidence if someone can rerun it: ``provenance("benchmarks/x.py")``
returns the lines a benchmark script puts at the top of its table (``ResultTable(meta=...)``), so the
JSON and the markdown both say how they were produced. Versions are read from package metadata, so
asking for Triton or Liger does not import them.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["provenance", "package_versions", "machine_description", "git_commit", "DEFAULT_PACKAGES"]

# what the project's benchmarks compare against or run on; one missing is reported as such
DEFAULT_PACKAGES: tuple[str, ...] = ("torch", "triton", "numpy", "liger-kernel", "torchao", "torch-hd")


def package_versions(packages: Sequence[str] = DEFAULT_PACKAGES) -> str:
    """``"python 3.11.7, torch 2.13.0+cpu (CUDA none), triton 3.5.0, liger-kernel not installed"``."""
    parts = [f"python {platform.python_version()}"]
    for name in packages:
        try:
            v = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
            continue
        if name == "torch" and "torch" in sys.modules:
            v += f" (CUDA {sys.modules['torch'].version.cuda or 'none'})"
        parts.append(f"{name} {v}")
    return ", ".join(parts)


def machine_description(device: str | None = None) -> str:
    """CPU model and usable cores, plus the GPU (name, capability, memory) when ``device`` is CUDA."""
    from torchnitro.hardware import hardware_info

    hw = hardware_info()
    cpu = f"{hw.cpu_name}, {hw.cpu_cores} cores"
    if device is not None and device.startswith("cuda") and hw.gpu_name:
        cap = ".".join(map(str, hw.gpu_capability or ()))
        gib = (hw.gpu_memory_bytes or 0) / 2**30
        return f"{hw.gpu_name} (capability {cap}, {gib:.0f} GiB); host {cpu}"
    return cpu


def git_commit(repo: str | Path | None = None) -> str:
    """Short commit of the checkout the script runs from, with ``+dirty`` when files are modified."""
    cwd = Path(repo) if repo is not None else Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def provenance(script: str, argv: Sequence[str] | None = None, *, device: str | None = None,
               packages: Sequence[str] = DEFAULT_PACKAGES) -> dict[str, str]:
    """The header of a results file: command, machine, versions, threads, load, commit and time.

    ``script`` is the path a reader would type (``"benchmarks/kernels.py"``); ``argv`` defaults to
    ``sys.argv[1:]``. ``device`` ("cpu" / "cuda") picks whether the GPU is the machine.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    out = {
        "command": shlex.join(["python", script, *args]),
        "machine": machine_description(device),
        "versions": package_versions(packages),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if "torch" in sys.modules:
        out["torch threads"] = str(sys.modules["torch"].get_num_threads())
    if hasattr(os, "getloadavg"):
        out["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return out
