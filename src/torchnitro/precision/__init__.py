"""torchnitro.precision: autocast policy by hardware, a mixed-precision train step, FP8 scaling
and an FP8 linear layer (tensor cores where present, emulated elsewhere)."""

from __future__ import annotations

from torchnitro.precision.float8_linear import Float8Linear, scaled_mm_available, to_float8_
from torchnitro.precision.fp8 import (
    E4M3, E5M2, Float8Config, ScaleState, amax_to_scale, cast_to_fp8, fp8_max, quantize_dequantize, sqnr,
)
from torchnitro.precision.policy import PrecisionPolicy, choose_policy
from torchnitro.precision.train_step import TrainStep

__all__ = [
    "PrecisionPolicy", "choose_policy", "TrainStep",
    "E4M3", "E5M2", "Float8Config", "ScaleState", "amax_to_scale", "cast_to_fp8", "fp8_max",
    "quantize_dequantize", "sqnr", "Float8Linear", "to_float8_", "scaled_mm_available",
]
