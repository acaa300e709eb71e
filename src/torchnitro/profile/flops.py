"""FLOP formulas ``FlopCounterMode`` lacks or overcounts, passed to it as ``custom_mapping``.

- SDPA on CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) has no formula in
  torch (2.13 counts 0 FLOPs for attention on CPU); it gets torch's own SDPA count.
- Causal attention is counted by torch as the full Lq x Lk square. With ``is_causal`` (torch's
  top-left aligned mask: query i sees keys 0..i) only the kept pairs are counted, once: the
  square times ``causal_fraction(Lq, Lk)`` (about 1/2 for long sequences).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["causal_fraction", "attention_mapping"]

# op -> (backward?, position of is_causal among the positional args), from the ops' schemas
_OPS: dict[str, tuple[bool, int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (False, 4),
    "_scaled_dot_product_flash_attention": (False, 4),
    "_scaled_dot_product_efficient_attention": (False, 6),
    "_scaled_dot_product_cudnn_attention": (False, 6),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (True, 7),
    "_scaled_dot_product_flash_attention_backward": (True, 11),
    "_scaled_dot_product_efficient_attention_backward": (True, 11),
}


def causal_fraction(lq: int, lk: int) -> float:
    """Share of the Lq x Lk score matrix a top-left causal mask keeps (query i sees keys 0..i)."""
    if lq <= 0 or lk <= 0:
        return 0.0
    kept = lq * (lq + 1) // 2 if lq <= lk else lk * (lk + 1) // 2 + (lq - lk) * lk
    return kept / (lq * lk)


def _formula(backward: bool, causal_pos: int) -> Callable[..., int]:
    def flops(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        causal = bool(kwargs.get("is_causal", args[causal_pos] if len(args) > causal_pos else False))
        if backward:
            grad, q, k, v = args[:4]
            n = sdpa_backward_flop_count(grad, q, k, v)
        else:
            q, k, v = args[:3]
            n = sdpa_flop_count(q, k, v)
        return int(n * causal_fraction(q[-2], k[-2])) if causal else int(n)
    return flops


def attention_mapping() -> dict[Any, Callable[..., int]]:
    """``custom_mapping`` for ``FlopCounterMode``: every SDPA op this torch build has."""
    out = {}
    for name, (backward, pos) in _OPS.items():
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            out[op] = _formula(backward, pos)
    return out
