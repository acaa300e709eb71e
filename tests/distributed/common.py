"""The tiny LM, data and training steps that both the ranks and the single-process reference run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchnitro.nn.models import TransformerConfig, TransformerLM

__all__ = ["MODEL", "tiny_lm", "tokens", "two_steps"]

# GQA (2 kv heads for 4 query heads) so TP=2 splits both; hidden 128
MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def tiny_lm() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**MODEL))


def tokens(batch: int = 8, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (batch, seq + 1), generator=g)  # (B, T+1): inputs and targets


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def two_steps(model: torch.nn.Module, x: torch.Tensor, reduce=lambda t: t, grads=None):
    """Loss, backward, SGD step, loss again: ([loss1, loss2], gradients of step 1).

    ``reduce`` turns a rank's local mean loss into the global one; ``grads(model)`` reads the gradients.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss1 = _loss(model, x)
    loss1.backward()
    g = grads(model)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        loss2 = _loss(model, x)
    return [reduce(loss1.detach()).item(), reduce(loss2).item()], g
