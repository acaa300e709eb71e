"""Shared helpers: a steady-state TransformerLM training step, tracked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchnitro.memory import checkpoint_, track
from torchnitro.nn.models import TransformerConfig, TransformerLM


def lm_step(cfg: TransformerConfig, batch: int, seq: int, dtype: torch.dtype = torch.float32, policy: object = "none"):
    """Model, optimizer, and a ``step()`` closure: cross-entropy, backward, AdamW, zero_grad."""
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(dtype)
    checkpoint_(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def tracked_peak(cfg: TransformerConfig, batch: int, seq: int, dtype: torch.dtype = torch.float32,
                 policy: object = "none"):
    model, opt, step = lm_step(cfg, batch, seq, dtype, policy)
    step()  # create optimizer state: measure the steady state
    with track(model, opt) as t:
        step()
    return t.report()
