"""``TrainStep``: one optimizer step with autocast and loss scaling chosen by hardware.

A thin layer over ``torch.autocast`` and ``torch.amp.GradScaler`` (not a rewrite): it decides the
dtype once (``choose_policy``), runs forward and loss under autocast, scales the loss when fp16 needs
it, unscales before clipping, and skips steps whose gradients overflowed (the scaler's rule).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.precision.policy import PrecisionPolicy, choose_policy

__all__ = ["TrainStep"]


def _default_loss(out: Tensor, target: Tensor) -> Tensor:
    if out.dim() >= 2 and not torch.is_floating_point(target):  # class indices: cross entropy
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
    return nn.functional.mse_loss(out.float(), target.float())


class TrainStep:
    """``step(*inputs, target=...)`` -> loss value; ``report()`` says what was decided and what happened."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: str = "auto", *,
                 loss_fn: Callable[[Any, Any], Tensor] | None = None, max_grad_norm: float | None = None,
                 device: torch.device | str | None = None, init_scale: float = 2.0 ** 16):
        if not isinstance(model, nn.Module):
            raise InputError(f"TrainStep: model received {type(model).__name__}, expected an nn.Module")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError(f"TrainStep: optimizer received {type(optimizer).__name__}, expected a torch.optim.Optimizer")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm: received {max_grad_norm!r}, expected a positive number or None")
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None else "cpu"
        self.model, self.optimizer = model, optimizer
        self.policy: PrecisionPolicy = choose_policy(policy, device)
        self.loss_fn = loss_fn or _default_loss
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler(self.policy.device_type, init_scale=init_scale,
                                           enabled=self.policy.grad_scaler)
        self.steps = 0
        self.skipped = 0  # steps the scaler skipped because gradients overflowed
        self.last_grad_norm: float | None = None

    def __call__(self, *inputs: Any, target: Any = None) -> float:
        self.model.train()
        with torch.autocast(self.policy.device_type, dtype=self.policy.dtype, enabled=self.policy.autocast):
            out = self.model(*inputs)
            loss = self.loss_fn(out, target) if target is not None else out
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise InputError("TrainStep: the loss must be a scalar tensor; pass target= with a loss_fn, "
                             f"or return a scalar from the model (received {type(loss).__name__})")
        self.scaler.scale(loss).backward()
        if self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.last_grad_norm = float(norm)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.is_enabled() and self.scaler.get_scale() < scale_before:
            self.skipped += 1  # the scaler backs off only when it found inf/NaN and skipped the step
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        value = float(loss.detach())
        return value if math.isfinite(value) else float("nan")

    def report(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name, "device": self.policy.device_type, "reason": self.policy.reason,
            "autocast_dtype": str(self.policy.dtype) if self.policy.autocast else None,
            "grad_scaler": self.policy.grad_scaler,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
            "steps": self.steps, "skipped_steps": self.skipped,
        }
