"""Activation checkpointing applied in place: ``checkpoint_(model, policy)``.

Policies (all use ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``):

- ``"blocks"``: every repeated block keeps only its inputs; its insides are recomputed in backward.
- ``"every_<n>"`` (e.g. ``"every_2"``): one block in ``n`` is checkpointed (blocks n-1, 2n-1, ...),
  the torchtitan "layer-selective" scheme; memory lands between none and ``blocks``.
- ``"selective"``: every block, but through PyTorch's selective checkpoint contexts: outputs of
  attention kernels and of the matmuls that open a branch (q/k/v, gate/up) are saved
  (``MUST_SAVE``); pointwise ops, norms and the output projections back into the residual stream
  (``RECOMPUTE_MODULES``: attention ``wo``/``o_proj``, MLP ``w2``/``down_proj``...) are recomputed
  (``PREFER_RECOMPUTE``). An output projection frees a D-wide tensor for one matmul, and the last
  one of a block (``w2``) feeds only the residual add, so the recompute stops before it (PyTorch's
  early stop): the extra work is the pointwise ops, the norms and one ``wo`` matmul per block.
  ``recompute=()`` keeps every matmul output (less recompute, more memory).
- ``Budget(fraction)``: checkpoint just enough blocks, spread evenly, to bring activation memory
  to ``fraction`` of the unchecked model (estimated with the planner for ``TransformerLM``).
- ``"none"``: undo a previous ``checkpoint_``.

"Blocks" are the entries of the model's largest ``nn.ModuleList`` (``model.blocks`` in the reference
models, ``model.layers`` / ``h`` / ``encoder.layer`` in HF models), or the list passed as ``blocks``.
Wrapping replaces the block's ``forward`` attribute only, so parameter names and state dicts are
unchanged and the model stays picklable by state dict.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchnitro.errors import InputError
from torchnitro.memory.planner import Budget, checkpoint_indices, plan

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["checkpoint_", "find_blocks", "selective_policy", "SAVE_OPS", "RECOMPUTE_MODULES",
           "checkpointed_blocks", "recompute_scope_modules"]

_ORIG = "_torchnitro_orig_forward"
_HOOKS = "_torchnitro_sac_hooks"

# names (last components of a submodule's qualified name inside a block) of the projections back into
# the residual stream: reference LM (wo, w2), Llama/Mistral (o_proj, down_proj), GPT-2 (c_proj),
# ViT/OPT (out_proj, fc2), BERT (attention.output.dense, output.dense)
RECOMPUTE_MODULES = ("wo", "w2", "o_proj", "down_proj", "out_proj", "c_proj", "fc2", "output.dense")


def _ops(*names: str) -> set[OpOverload]:
    out = set()
    for n in names:
        pkt, _, overload = n.partition(".")
        packet = getattr(torch.ops.aten, pkt, None)
        if packet is not None and hasattr(packet, overload or "default"):
            out.add(getattr(packet, overload or "default"))
    return out


# outputs of these ops are expensive to recompute: keep them
SAVE_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "convolution",
)


@dataclass
class _Scope:
    """How deep the running code is inside modules whose matmuls are recomputed (set by hooks)."""

    depth: int = 0


def selective_policy(ctx: Any, op: OpOverload, *args: Any, save_ops: Collection[OpOverload] | None = None,
                     scope: _Scope | None = None, **kwargs: Any) -> CheckpointPolicy:
    """Save outputs of ``save_ops`` (default: matmul/attention ops) unless they run inside a module
    listed for recompute (``scope.depth > 0``); recompute everything else.

    Called for every ATen op of a checkpointed block, in forward and again in the recompute, so it
    does two lookups and nothing else.
    """
    if op in (SAVE_OPS if save_ops is None else save_ops) and not (scope is not None and scope.depth):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its largest ``nn.ModuleList`` (ties: the first found)."""
    best: nn.ModuleList | None = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (best is None or len(m) > len(best)):
            best = m
    if best is None:
        raise InputError(f"checkpoint_: {type(model).__name__} has no nn.ModuleList of blocks; "
                         "expected repeated blocks, or pass blocks=[...] explicitly")
    return best


def _unwrap(block: nn.Module) -> None:
    if _ORIG in block.__dict__:
        del block.__dict__["forward"]
        del block.__dict__[_ORIG]
    for h in block.__dict__.pop(_HOOKS, ()):
        h.remove()


def recompute_scope_modules(block: nn.Module, names: Sequence[str] = RECOMPUTE_MODULES) -> list[str]:
    """Qualified names of ``block``'s submodules that match ``names`` (whole trailing components)."""
    pats = tuple(names)
    return [q for q, _ in block.named_modules() if q and any(q == p or q.endswith("." + p) for p in pats)]


def _scope_hooks(block: nn.Module, names: Sequence[str]) -> tuple[_Scope, list[Any]]:
    """A scope whose depth counts the matched submodules running (also during the recompute)."""
    scope, handles = _Scope(), []

    def enter(*_: Any) -> None:
        scope.depth += 1

    def leave(*_: Any) -> None:
        scope.depth -= 1

    for q in recompute_scope_modules(block, names):
        m = block.get_submodule(q)
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))  # also when forward raises
    return scope, handles


def _wrap(block: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    orig = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
            return orig(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(orig, *args, use_reentrant=False, **extra, **kwargs)

    block.__dict__[_ORIG] = orig
    block.__dict__["forward"] = functools.wraps(orig)(forward)


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks of ``model`` that ``checkpoint_`` wrapped."""
    blocks = find_blocks(model)
    return [i for i, b in enumerate(blocks) if _ORIG in b.__dict__]


def _budget_count(model: nn.Module, n: int, fraction: float) -> int:
    """How many of ``n`` blocks to checkpoint so activations fall to ``fraction`` of unchecked.

    For ``TransformerLM`` the planner decides (it knows the head's share and what a checkpointed
    block still holds); for other models activations are assumed to live in the blocks.
    """
    from torchnitro.nn.models import TransformerConfig

    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, TransformerConfig) and cfg.n_layers == n:
        dev = next(model.parameters()).device.type
        p = plan(cfg, batch=1, seq=min(128, cfg.max_seq_len), checkpointing=Budget(fraction),
                 device=dev if dev in ("cpu", "cuda") else "cpu")
        return int(p.inputs["checkpointed_layers"])
    return min(n, max(0, math.ceil(n * (1 - fraction) - 1e-9)))


def _parse(policy: str | Budget) -> tuple[str, int]:
    if isinstance(policy, Budget):
        return "budget", 0
    if policy in ("none", "blocks", "selective"):
        return policy, 1
    if isinstance(policy, str) and policy.startswith("every_"):
        tail = policy[len("every_"):]
        if tail.isdigit() and int(tail) >= 1:
            return "every_n", int(tail)
    raise InputError(f"checkpoint_ policy: received {policy!r}, expected 'blocks', 'every_<n>' (n >= 1), "
                     "'selective', 'none' or memory.Budget(fraction)")


def checkpoint_(model: nn.Module, policy: str | Budget = "blocks", *, blocks: Sequence[nn.Module] | None = None,
                save_ops: Collection[OpOverload] | None = None, recompute: Sequence[str] | None = None) -> nn.Module:
    """Apply activation checkpointing to ``model``'s blocks in place; returns ``model``.

    Calling it again replaces the previous policy. Outputs and gradients are the same as without
    checkpointing (the recompute runs the same ops with the same RNG state). For the ``selective``
    policy, ``save_ops`` (a set of ``torch.ops.aten`` overloads) replaces ``SAVE_OPS`` and
    ``recompute`` (submodule names, matched on whole trailing components) replaces
    ``RECOMPUTE_MODULES``; ``recompute=()`` saves every matmul output.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"checkpoint_: received {type(model).__name__}, expected an nn.Module")
    kind, n = _parse(policy)
    blist = list(blocks) if blocks is not None else list(find_blocks(model))
    for b in blist:
        _unwrap(b)
    if kind == "none":
        return model
    L = len(blist)
    count = _budget_count(model, L, policy.fraction) if kind == "budget" else 0
    chosen = checkpoint_indices(kind, L, n, count)
    for name, arg in (("save_ops", save_ops), ("recompute", recompute)):
        if arg is not None and kind != "selective":
            raise InputError(f"{name} applies to policy 'selective' only; received policy {policy!r}")
    if isinstance(recompute, str):
        raise InputError(f"recompute: received the string {recompute!r}, expected a sequence of module names "
                         f"such as ('wo', 'w2'); wrap a single name in a tuple")
    keep = frozenset(save_ops) if save_ops is not None else SAVE_OPS
    for i in chosen:
        ctx = None
        if kind == "selective":
            scope, handles = _scope_hooks(blist[i], RECOMPUTE_MODULES if recompute is None else recompute)
            blist[i].__dict__[_HOOKS] = handles
            pol = functools.partial(selective_policy, save_ops=keep, scope=scope)
            ctx = functools.partial(create_selective_checkpoint_contexts, pol)
        _wrap(blist[i], ctx)
    return model
