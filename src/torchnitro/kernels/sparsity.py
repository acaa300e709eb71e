"""2:4 structured sparsity for Linear layers (NVIDIA Ampere+ sparse tensor cores).

In every group of 4 consecutive weights along the input dim, keep the 2 of largest magnitude
(Mishra et al., 2021, "Accelerating Sparse Deep Neural Networks"). ``prune_2to4`` computes the mask
anywhere; ``verify_2to4`` checks a weight; ``to_semi_structured`` converts a pruned Linear to
PyTorch's ``SparseSemiStructuredTensor`` (CUDA, compute capability >= 8.0, fp16/bf16), where
``F.linear`` runs on the sparse tensor cores. ``sparsify_(model)`` does prune + convert on every
eligible Linear and returns what it did. ``SemiSparseLinear`` is the inference module the
``sparse-2:4`` recipe swaps in: semi-structured on the GPU, the dense pruned weight elsewhere (the
reference it is tested against), and the dense pruned weight again if a sparse call fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError

__all__ = ["prune_2to4", "mask_2to4", "verify_2to4", "semi_structured_supported", "to_semi_structured",
           "sparsify_", "SparsityReport", "SemiSparseLinear", "semi_structured_reason"]


def mask_2to4(weight: Tensor) -> Tensor:
    """Boolean mask (same shape) keeping the 2 largest-|w| entries of every 4 along the last dim."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        raise ShapeError(f"2:4 sparsity: weight has shape {tuple(weight.shape)}; expected 2-d (out, in) with in "
                         "divisible by 4; pad the input features or skip this layer")
    groups = weight.detach().abs().reshape(weight.shape[0], -1, 4)  # (out, in/4, 4)
    top = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return mask.reshape(weight.shape)


def prune_2to4(weight: Tensor) -> Tensor:
    """A 2:4-sparse copy of ``weight`` (zeros where :func:`mask_2to4` drops)."""
    return weight * mask_2to4(weight)


def verify_2to4(weight: Tensor) -> bool:
    """True when every group of 4 along the last dim has at most 2 non-zeros."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    nz = (weight.detach().reshape(weight.shape[0], -1, 4) != 0).sum(-1)
    return bool((nz <= 2).all())


def semi_structured_supported(device: torch.device | str | None = None) -> str | None:
    """None when semi-structured sparse matmuls can run on ``device``, else the reason."""
    if not torch.cuda.is_available():
        return "2:4 semi-structured sparsity needs a CUDA GPU; none is visible"
    dev = torch.device(device or "cuda")
    if dev.type != "cuda":
        return f"2:4 semi-structured sparsity needs CUDA tensors (got {dev.type})"
    major, _ = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"2:4 semi-structured sparsity needs compute capability >= 8.0 (got {major}.x)"
    return None


def to_semi_structured(linear: nn.Linear, prune: bool = True) -> nn.Linear:
    """Prune (optional) and convert ``linear.weight`` in place to a semi-structured sparse tensor."""
    from torch.sparse import to_sparse_semi_structured

    reason = semi_structured_supported(linear.weight.device)
    if reason:
        raise BackendUnavailableError(f"to_semi_structured: {reason}; run on an Ampere or newer GPU, or keep the "
                                      "dense layer (prune_2to4 alone works on CPU)")
    if linear.weight.dtype not in (torch.float16, torch.bfloat16):
        raise InputError(f"to_semi_structured: weight dtype {linear.weight.dtype}; expected float16 or bfloat16; "
                         "call model.half() or .bfloat16() first")
    w = prune_2to4(linear.weight.detach()) if prune else linear.weight.detach()
    if not verify_2to4(w):
        raise InputError("to_semi_structured: weight is not 2:4 sparse; expected at most 2 non-zeros in every 4; "
                         "pass prune=True")
    linear.weight = nn.Parameter(to_sparse_semi_structured(w), requires_grad=False)
    return linear


@dataclass
class SparsityReport:
    converted: list[str] = field(default_factory=list)  # Linear layers now on sparse tensor cores
    pruned_only: list[str] = field(default_factory=list)  # pruned to 2:4 but kept dense (convert=False)
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why it was left alone


def sparsify_(model: nn.Module, convert: bool = True, min_features: int = 64, skip: tuple[str, ...] = ("lm_head",)
              ) -> SparsityReport:
    """Prune every eligible Linear of ``model`` to 2:4 in place; with ``convert`` also move it to
    semi-structured sparse storage (GPU only). Layers with features not multiples of 64, smaller than
    ``min_features`` or named in ``skip`` stay dense and are listed in the report."""
    report = SparsityReport()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if any(s in name for s in skip):
            report.skipped[name] = "name is in skip"
            continue
        o, i = mod.weight.shape
        if o < min_features or i < min_features or o % 64 or i % 64:
            report.skipped[name] = f"shape {(o, i)}: both dims must be multiples of 64 and >= {min_features}"
            continue
        if convert:
            to_semi_structured(mod, prune=True)
            report.converted.append(name)
        else:
            with torch.no_grad():
                mod.weight.mul_(mask_2to4(mod.weight))
            report.pruned_only.append(name)
    return report


SPARSE_NEEDS = "needs CUDA sm_80+ with cuSPARSELt/CUTLASS semi-structured sparse"
_warned: set[str] = set()


def semi_structured_reason(device: torch.device | str | None = None) -> str | None:
    """None when semi-structured sparse ``F.linear`` runs on ``device``, else a line starting with what it needs."""
    try:
        from torch.sparse import to_sparse_semi_structured  # noqa: F401
    except ImportError:
        return f"{SPARSE_NEEDS}; torch {torch.__version__} has no torch.sparse.to_sparse_semi_structured"
    why = semi_structured_supported(device)
    return None if why is None else f"{SPARSE_NEEDS}; {why}"


def _semi_structured(w: Tensor) -> Tensor:
    """``w`` (2:4 sparse) as torch's default semi-structured tensor (cuSPARSELt), else the CUTLASS one."""
    from torch.sparse import SparseSemiStructuredTensorCUTLASS, to_sparse_semi_structured

    try:
        return to_sparse_semi_structured(w)
    except Exception:  # noqa: BLE001 - a torch build without cuSPARSELt: the CUTLASS kernels need no library
        return SparseSemiStructuredTensorCUTLASS.from_dense(w)


class SemiSparseLinear(nn.Module):
    """Inference ``y = x W^T + b`` with ``W`` pruned to 2:4 (``prune_2to4``; the source layer is not changed).

    ``backend``: 'auto' stores ``W`` semi-structured (cuSPARSELt where torch has it, else CUTLASS)
    when the layer is on an Ampere+ GPU in fp16/bf16 with features that are multiples of 64, and
    the dense pruned weight otherwise; 'sparse' requires the sparse path (raises where it cannot);
    'dense' always keeps the dense pruned weight (the reference)."""

    def __init__(self, linear: nn.Linear, backend: str = "auto"):
        super().__init__()
        if backend not in ("auto", "sparse", "dense"):
            raise InputError(f"SemiSparseLinear: backend={backend!r}; expected 'auto', 'sparse' or 'dense'")
        w = prune_2to4(linear.weight.detach())  # (N, K), zeros where the 2:4 mask drops
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        why = None if backend == "dense" else self._sparse_reason(w)
        if backend == "sparse" and why is not None:
            raise BackendUnavailableError(f"SemiSparseLinear(backend='sparse'): {why}. Use backend='auto'")
        stored: Tensor = w
        if backend != "dense" and why is None:
            try:
                stored = _semi_structured(w)
            except Exception as exc:  # noqa: BLE001 - a shape/dtype the sparse kernels reject keeps the dense weight
                if backend == "sparse":
                    raise BackendUnavailableError(f"SemiSparseLinear: to_sparse_semi_structured failed on weight "
                                                  f"{tuple(w.shape)} {w.dtype}: {exc}") from exc
                warnings.warn(f"SemiSparseLinear: to_sparse_semi_structured failed on weight {tuple(w.shape)} "
                              f"({type(exc).__name__}: {exc}); keeping the dense pruned weight", stacklevel=2)
        self.sparse = stored is not w
        self.register_buffer("weight", stored, persistent=False)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None, persistent=False)

    @staticmethod
    def _sparse_reason(w: Tensor) -> str | None:
        why = semi_structured_reason(w.device)
        if why is None and w.dtype not in (torch.float16, torch.bfloat16):
            why = f"weight dtype {w.dtype}; semi-structured sparse needs float16 or bfloat16"
        if why is None and (w.shape[0] % 64 or w.shape[1] % 64):
            why = f"weight shape {tuple(w.shape)}: semi-structured sparse needs both dims multiples of 64"
        return why

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sparse={self.sparse}"

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, K): the sparse kernels take 2-d row-major input
        if self.sparse and x2.shape[0]:
            try:
                y = F.linear(x2, self.weight, self.bias)
                return y.reshape(*lead, self.out_features)
            except Exception as exc:  # noqa: BLE001 - a failing sparse kernel falls back to the same math, dense
                self.weight, self.sparse = self.weight.to_dense(), False
                if "linear" not in _warned:
                    _warned.add("linear")
                    warnings.warn(f"SemiSparseLinear: the semi-structured matmul failed ({type(exc).__name__}: "
                                  f"{exc}); continuing with the dense pruned weight (same math, not faster)",
                                  stacklevel=2)
        return F.linear(x2, self.weight, self.bias).reshape(*lead, self.out_features)
