"""FP8 scaling: e4m3 for the forward pass (weights, activations), e5m2 for gradients.

A tensor ``x`` is cast as ``q = saturate(x * scale)`` with ``scale = fp8_max / amax / 2**margin``;
``x ≈ q / scale``. Two recipes (Micikevicius et al., "FP8 Formats for Deep Learning", 2022; NVIDIA
Transformer Engine's ``DelayedScaling``):

- ``dynamic``: ``amax`` is the current tensor's max |x| (one extra reduction per cast, exact fit);
- ``delayed``: ``amax`` comes from a history of the last ``history_len`` steps, reduced with ``max``
  or ``most_recent``; the current amax is pushed after the cast, so the scale never waits on the
  tensor it scales.

Edge cases: ``amax == 0`` (an all-zero tensor) gives scale 1; a non-finite amax (inf/NaN from an
overflowed step) keeps the previous scale (1 when there is none) and is not pushed into the history,
so one bad step cannot poison the next ``history_len`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torchnitro.errors import ConfigError, InputError

__all__ = [
    "E4M3", "E5M2", "fp8_max", "amax_to_scale", "cast_to_fp8", "quantize_dequantize", "sqnr",
    "Float8Config", "ScaleState",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_RECIPES = ("dynamic", "delayed")
_AMAX_COMPUTE = ("max", "most_recent")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in (E4M3, E5M2):
        raise InputError(f"fp8 dtype: received {dtype}, expected torch.float8_e4m3fn or torch.float8_e5m2")
    return float(torch.finfo(dtype).max)


def amax_to_scale(amax: Tensor | float, dtype: torch.dtype, margin: int = 0,
                  previous: Tensor | float | None = None) -> Tensor:
    """``fp8_max / amax / 2**margin`` as a float32 scalar tensor, with the edge cases handled."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    prev = torch.as_tensor(1.0 if previous is None else previous, dtype=torch.float32, device=a.device)
    raw = fp8_max(dtype) / torch.where(a > 0, a, torch.ones_like(a)) / (2.0 ** margin)
    fmax = torch.finfo(torch.float32).max
    raw = torch.clamp(raw, max=fmax)  # a subnormal amax must not give an inf scale
    scale = torch.where(a > 0, raw, torch.ones_like(a))
    return torch.where(torch.isfinite(a), scale, prev)


def cast_to_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Saturating cast: values beyond fp8 range clamp to +-max instead of becoming NaN."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def quantize_dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``cast_to_fp8`` then back to ``x.dtype``: the emulated fp8 path used off FP8 hardware."""
    return (cast_to_fp8(x, scale, dtype).float() / scale).to(x.dtype)


def sqnr(ref: Tensor, approx: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(||ref|| / ||ref - approx||)``."""
    r, a = ref.detach().double(), approx.detach().double()
    noise = torch.linalg.vector_norm(r - a)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(r) / noise))


@dataclass(frozen=True)
class Float8Config:
    scaling: str = "dynamic"  # "dynamic" (current amax) or "delayed" (amax history)
    history_len: int = 16  # delayed: steps of amax kept; TE's default is 1024, 16 reacts faster
    amax_compute: str = "max"  # delayed: reduce the history with "max" or "most_recent"
    margin: int = 0  # extra headroom: scale divided by 2**margin
    backend: str = "auto"  # "auto", "scaled_mm" (FP8 tensor cores), "emulated" or "torchao"

    def __post_init__(self) -> None:
        if self.scaling not in _RECIPES:
            raise ConfigError(f"scaling: received {self.scaling!r}, expected one of {list(_RECIPES)}")
        if self.amax_compute not in _AMAX_COMPUTE:
            raise ConfigError(f"amax_compute: received {self.amax_compute!r}, expected one of {list(_AMAX_COMPUTE)}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ConfigError(f"history_len: received {self.history_len!r}, expected a positive integer")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ConfigError(f"margin: received {self.margin!r}, expected a non-negative integer")
        if self.backend not in ("auto", "scaled_mm", "emulated", "torchao"):
            raise ConfigError(f"backend: received {self.backend!r}, expected auto, scaled_mm, emulated or torchao")


class ScaleState:
    """Scale of one tensor role (input, weight or grad) of one layer, under one recipe."""

    def __init__(self, dtype: torch.dtype, config: Float8Config, device: torch.device | str = "cpu"):
        fp8_max(dtype)
        self.dtype, self.config = dtype, config
        self.history = torch.zeros(config.history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.steps = 0
        self.skipped = 0  # non-finite amaxes seen (kept out of the history)

    def _history_amax(self) -> Tensor:
        if self.config.amax_compute == "most_recent":
            return self.history[(self.steps - 1) % self.history.numel()]
        return self.history.max()

    def sync_device(self, device: torch.device) -> None:
        """Keep the state on the device of the tensors it scales."""
        if self.history.device != device:
            self.history, self.scale = self.history.to(device), self.scale.to(device)

    @torch.no_grad()
    def scale_for(self, x: Tensor) -> Tensor:
        """Scale to cast ``x`` with now; records ``x``'s amax for the delayed recipe."""
        self.sync_device(x.device)
        amax = x.detach().abs().amax().float()
        if self.config.scaling == "dynamic":
            self.scale = amax_to_scale(amax, self.dtype, self.config.margin, self.scale)
            return self.scale
        if self.steps > 0:
            self.scale = amax_to_scale(self._history_amax(), self.dtype, self.config.margin, self.scale)
        else:  # no history yet: bootstrap from this tensor so the first step is not saturated
            self.scale = amax_to_scale(amax, self.dtype, self.config.margin, self.scale)
        used = self.scale.clone()
        if bool(torch.isfinite(amax)):
            self.history[self.steps % self.history.numel()] = amax
            self.steps += 1
        else:
            self.skipped += 1
        return used
