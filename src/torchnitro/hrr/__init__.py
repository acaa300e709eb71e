"""torchnitro.hrr: holographic reduced representations (Plate, 1995) on PyTorch.

Ops (``bind``, ``unbind``, ``superpose``, ...) broadcast over leading dimensions and run on any
device; ``ItemMemory`` answers cleanup queries with one matrix product per chunk; ``Record`` and
``Sequence`` build structures; ``calibrate`` measures where the GPU starts to pay off.
"""

from __future__ import annotations

from torchnitro.hrr.dispatch import Calibration, Dispatcher, calibrate
from torchnitro.hrr.fused import bind_normalize, bind_superpose
from torchnitro.hrr.memory import ItemMemory
from torchnitro.hrr.structures import Record, Sequence, capacity, measure_accuracy, role_vector
from torchnitro.hrr.ops import (
    UNBIND_METHODS, bind, cosine, exact_inverse, inverse, normalize, permutation, permute, project,
    random, superpose, unbind, unitary, unpermute,
)

__all__ = [
    "Record", "Sequence", "capacity", "measure_accuracy", "role_vector",
    "Calibration", "Dispatcher", "calibrate", "ItemMemory", "bind_normalize", "bind_superpose",
    "UNBIND_METHODS", "bind", "cosine", "exact_inverse", "inverse", "normalize", "permutation",
    "permute", "project", "random", "superpose", "unbind", "unitary", "unpermute",
]
