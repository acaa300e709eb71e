"""Which autocast dtype (and whether loss scaling) to use, decided from the hardware.

``choose_policy("auto", device)``:

- CUDA with bf16 support (Ampere, capability >= 8.0, and later): bf16 autocast, no loss scaling
  (bf16 has fp32's exponent range, so gradients do not underflow);
- older CUDA GPUs: fp16 autocast with ``torch.amp.GradScaler`` (fp16's 5-bit exponent underflows
  small gradients without scaling);
- CPUs with native bf16 (AVX512-BF16 or AMX, via ``torchnitro.hardware``): bf16 autocast;
- other CPUs: fp32 (emulated bf16 would be slower than fp32 there).

Every decision carries its reason, so ``TrainStep.report()`` can say why it picked what it did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchnitro.errors import InputError
from torchnitro.hardware import HardwareInfo, hardware_info

__all__ = ["PrecisionPolicy", "choose_policy", "POLICIES"]

POLICIES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionPolicy:
    device_type: str  # "cuda" or "cpu": the autocast device type
    name: str  # "bf16", "fp16" or "fp32"
    grad_scaler: bool  # use torch.amp.GradScaler (fp16 only)
    reason: str  # why this was chosen

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast(self) -> bool:
        return self.name != "fp32"

    def __str__(self) -> str:
        scaler = " + GradScaler" if self.grad_scaler else ""
        return f"{self.name}{scaler} on {self.device_type}: {self.reason}"


def choose_policy(policy: str = "auto", device: torch.device | str | None = None,
                  hw: HardwareInfo | None = None) -> PrecisionPolicy:
    """Resolve ``policy`` ('auto', 'bf16', 'fp16', 'fp32') for ``device`` into a decision."""
    if policy not in POLICIES:
        raise InputError(f"precision policy: received {policy!r}, expected one of {list(POLICIES)}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cuda", "cpu"):
        raise InputError(f"device: received {dev}, expected a cuda or cpu device")
    hw = hw or hardware_info()
    if policy == "fp32":
        return PrecisionPolicy(dev.type, "fp32", False, "requested")
    if policy == "fp16":
        return PrecisionPolicy(dev.type, "fp16", True, "requested; fp16 needs loss scaling")
    if policy == "bf16":
        return PrecisionPolicy(dev.type, "bf16", False, "requested")
    if dev.type == "cuda":
        cap = hw.gpu_capability or torch.cuda.get_device_capability(dev)
        if cap >= (8, 0):
            return PrecisionPolicy("cuda", "bf16", False, f"GPU capability {cap[0]}.{cap[1]} >= 8.0 has bf16 tensor cores")
        return PrecisionPolicy("cuda", "fp16", True,
                               f"GPU capability {cap[0]}.{cap[1]} < 8.0: no bf16 tensor cores; fp16 with loss scaling")
    if hw.cpu_bf16:
        flags = [f for f in hw.cpu_flags if f in ("avx512_bf16", "amx_bf16")]
        return PrecisionPolicy("cpu", "bf16", False, f"CPU has native bf16 ({', '.join(flags)})")
    return PrecisionPolicy("cpu", "fp32", False, "CPU lacks avx512_bf16/AMX: bf16 would be emulated and slower")
