"""Parity checks: gather a parallelized model's parameters or gradients into full tensors by name,
and compare them with a single-process reference, so a silently wrong gradient is caught.

Names are the unwrapped model's (DDP's ``module.`` prefix removed; FSDP2, TP and activation
checkpointing keep names), so one reference ``named_parameters()`` lines up with every layout.
Every rank must call ``full_tensors`` together: gathering a DTensor is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["full_tensors", "ParityReport", "compare"]


def full_tensors(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: full fp32 CPU tensor} of every parameter (or its gradient; None gradients are skipped)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.data if not isinstance(p, DTensor) else p
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name.removeprefix("module.")] = t.detach().float().cpu()
    return out


@dataclass
class ParityReport:
    worst: str  # name of the tensor with the largest relative error
    rel_err: float  # its ||a - b|| / ||b||
    missing: list[str]  # names in one dict but not the other

    @property
    def ok(self) -> bool:
        return not self.missing

    def within(self, rtol: float) -> bool:
        return self.ok and self.rel_err <= rtol


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> ParityReport:
    """Norm-relative error per tensor (robust to single entries near zero); reports the worst one."""
    missing = sorted(set(got) ^ set(want))
    worst, err = "", 0.0
    for name in sorted(set(got) & set(want)):
        a, b = got[name].double(), want[name].double()
        if a.shape != b.shape:
            return ParityReport(name, float("inf"), missing)
        e = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if e > err or not worst:
            worst, err = name, e
    return ParityReport(worst, err, missing)
