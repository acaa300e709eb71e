"""Tiny deterministic models for exercising a server (smoke tests, the reliability suite).

Each is a zero-argument factory, so it can be served by spec: ``torchnitro serve
torchnitro.serve.testing:affine --workers 2``. Results are a known function of the input, so a
client can check that every answer belongs to its own request.
"""

from __future__ import annotations

import os
import time

from torch import Tensor

from torchnitro.serve.models import ServedModel
from torchnitro.serve.protocol import ModelSignature, TensorSpec

__all__ = ["POISON", "affine", "slow_affine", "ragged_double"]

POISON = -999.0  # an input row starting with this value kills the worker process (crash tests)


def _affine_fn(delay_s: float):
    def fn(x: Tensor) -> Tensor:  # (B, 4) -> (B, 4)
        if bool((x[:, 0] == POISON).any()):
            os._exit(3)  # simulate a segfaulting extension: no exception, no goodbye
        if delay_s:
            time.sleep(delay_s)
        return x * 2 + 1

    return fn


def _affine_sig(name: str) -> ModelSignature:
    return ModelSignature(name, [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])


def affine() -> ServedModel:
    """``y = 2x + 1`` on ``(B, 4)`` float32; a row starting with ``POISON`` kills the process."""
    return ServedModel(_affine_fn(0.0), _affine_sig("affine"))


def slow_affine() -> ServedModel:
    """``affine`` that takes 50 ms per batch (queues build up: priorities, drain, deadlines)."""
    return ServedModel(_affine_fn(float(os.environ.get("TORCHNITRO_TEST_DELAY_S", "0.05"))),
                       _affine_sig("slow_affine"))


def ragged_double() -> ServedModel:
    """``(B, T)`` int64 tokens -> ``(B, T)`` float32 ``2 * tokens``: padding must be cut back off."""

    def fn(tokens: Tensor) -> Tensor:
        return tokens.float() * 2

    sig = ModelSignature("ragged_double", [TensorSpec("tokens", "INT64", (-1, -1))],
                         [TensorSpec("doubled", "FP32", (-1, -1))], padding_safe=True)
    return ServedModel(fn, sig)
