"""What this machine is: CPU flags, cores, GPU name and capability, library versions.

One ``HardwareInfo`` is computed per process (``hardware_info()`` caches it). Recipes use it to say
whether they apply; ``torchnitro doctor`` prints it; caches key on its ``fingerprint``. ``roofline_gemm_n``
is the size of the GEMM whose rate counts as this machine's peak (``autotune.analyze`` and ``profile.peak``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["HardwareInfo", "hardware_info", "library_versions", "has_cuda", "cpu_supports_bf16", "roofline_gemm_n"]

_INTERESTING_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "neon", "asimd", "sve",
)
_LIBRARIES = (
    "torch", "triton", "onnx", "onnxruntime", "onnxscript", "transformers", "safetensors",
    "numpy", "torch_tensorrt", "starlette", "uvicorn", "torchao", "openvino", "nncf",
)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str | None]:
    """Installed version of each library torchnitro may use (None when absent)."""
    out: dict[str, str | None] = {}
    for name in _LIBRARIES:
        dist = {"torch_tensorrt": "torch-tensorrt"}.get(name, name)
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__
    return out


@dataclass(frozen=True)
class HardwareInfo:
    cpu_name: str
    cpu_cores: int  # cores this process may use (affinity), not the machine's total
    cpu_flags: tuple[str, ...]  # the subset of flags that matter for recipes
    torch_threads: int
    gpu_name: str | None = None
    gpu_capability: tuple[int, int] | None = None
    gpu_memory_bytes: int | None = None
    libraries: dict[str, str | None] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    @property
    def cpu_bf16(self) -> bool:
        """True when the CPU computes bf16 natively (AVX512-BF16 or AMX), so bf16 can pay off."""
        return bool({"avx512_bf16", "amx_bf16"} & set(self.cpu_flags))

    @property
    def cpu_vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(self.cpu_flags))

    @property
    def fingerprint(self) -> str:
        """Short hash of what makes compiled artifacts non-portable (CPU, GPU, library versions)."""
        key = repr((self.cpu_name, self.cpu_flags, self.gpu_name, self.gpu_capability, sorted(self.libraries.items())))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)


def has_cuda() -> bool:
    return torch.cuda.is_available()


def cpu_supports_bf16() -> bool:
    return hardware_info().cpu_bf16


def roofline_gemm_n(device: str) -> int:
    """The side n of the square (n, n) @ (n, n) GEMM whose rate is the peak on ``device`` (``analyze.machine_roofline``
    and ``profile.peak`` time the same one): large enough to be compute-bound, small enough to time in well under a
    second."""
    return 4096 if torch.device(device).type == "cuda" else 1024


@functools.lru_cache(maxsize=1)
def hardware_info() -> HardwareInfo:
    flags = _cpu_flags()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    gpu_name = cap = mem = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu_name, cap, mem = props.name, (props.major, props.minor), int(props.total_memory)
    return HardwareInfo(
        cpu_name=_cpu_name(),
        cpu_cores=cores,
        cpu_flags=tuple(sorted(f for f in flags if f in _INTERESTING_FLAGS)),
        torch_threads=torch.get_num_threads(),
        gpu_name=gpu_name,
        gpu_capability=cap,
        gpu_memory_bytes=mem,
        libraries=library_versions(),
    )
