"""The verification gate: a candidate's outputs against eager fp32 on held-out inputs.

Outputs of any structure (tensor, tuple/list, dict, HF ``ModelOutput``) are flattened to a list of
named tensors. Per output we compute

* ``max_abs``  = max |ref - cand|
* ``max_rel``  = max |ref - cand| / (|ref| + eps)      (reported; elementwise, so noisy near zero)
* ``norm_rel`` = ||ref - cand||_2 / ||ref||_2           (the 'rel' the exact gate checks: fp32
  reassociation gives ~1e-7, a wrong kernel gives ~1)
* ``cosine``   = the worst cosine similarity over the output's rows (vectors along the last dim,
  one per sample or token): the reduced/int8 gate, so one bad sample cannot hide in the batch

With a user ``metric_fn(reference_outputs, candidate_outputs) -> float`` the metric (worst over the
input sets, must be >= the threshold) decides instead of the class tolerance; the errors above are
still reported.

A candidate is called twice per input set and the copies must agree; and an output it returned must
not change when it is called again (a candidate handing out a reused buffer, as raw CUDA graphs do,
fails).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["flatten_outputs", "OutputError", "GateResult", "compare_outputs", "collect", "judge", "clone_outputs"]


def flatten_outputs(out: Any, prefix: str = "output") -> list[tuple[str, Tensor]]:
    """(name, tensor) for every tensor in ``out``; dicts and ModelOutputs by key, sequences by index."""
    if isinstance(out, Tensor):
        return [(prefix, out)]
    if hasattr(out, "numpy") and hasattr(out, "shape") and not isinstance(out, Tensor):  # numpy array
        return [(prefix, torch.as_tensor(out))]
    if isinstance(out, dict) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        items: list[tuple[str, Tensor]] = []
        for k in out.keys():
            v = out[k]
            if v is not None:
                items += flatten_outputs(v, f"{k}" if prefix == "output" else f"{prefix}.{k}")
        return items
    if isinstance(out, (tuple, list)):
        items = []
        for i, v in enumerate(out):
            if v is not None:
                items += flatten_outputs(v, f"{prefix}_{i}")
        return items
    return []


def clone_outputs(out: Any) -> list[tuple[str, Tensor]]:
    """Flatten and copy to fp32 CPU, so a later call cannot overwrite what we compare."""
    return [(n, t.detach().to("cpu", torch.float32).clone()) for n, t in flatten_outputs(out)]


@dataclass
class OutputError:
    name: str
    max_abs: float
    max_rel: float
    norm_rel: float
    cosine: float


@dataclass
class GateResult:
    passed: bool
    reason: str  # why it failed ('' when passed)
    max_abs: float = 0.0  # worst over outputs and input sets
    max_rel: float = 0.0
    norm_rel: float = 0.0
    min_cosine: float = 1.0
    metric: float | None = None  # the user's metric_fn (worst over input sets), when given
    per_output: list[OutputError] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cosine(a: Tensor, b: Tensor) -> float:
    """Worst cosine over rows (vectors along the last dim: one per sample/token), so one bad sample
    in a batch cannot hide behind the good ones; whole-tensor cosine for scalars and 1-D outputs."""
    a, b = a.double(), b.double()
    if a.dim() < 2 or a.shape[-1] < 2:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(dim=1) / (na * nb).clamp_min(1e-300)
    cos = torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos)  # both zero: identical rows
    return float(cos.min()) if cos.numel() else 1.0


def compare_outputs(ref: list[tuple[str, Tensor]], cand: list[tuple[str, Tensor]]) -> list[OutputError] | str:
    """Per-output errors, or a string saying why the outputs cannot be compared."""
    if len(ref) != len(cand):
        return f"returned {len(cand)} output tensor(s), eager returns {len(ref)}"
    errs = []
    for (name, r), (_, c) in zip(ref, cand):
        if tuple(r.shape) != tuple(c.shape):
            return f"output {name!r} has shape {tuple(c.shape)}, eager gives {tuple(r.shape)}"
        r64, c64 = r.double(), c.double()
        if not torch.isfinite(c64).all() and torch.isfinite(r64).all():
            return f"output {name!r} has NaN/Inf where eager is finite"
        diff = (r64 - c64).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / (r64.abs() + 1e-6)).max()) if diff.numel() else 0.0
        rn = float(r64.norm())
        norm_rel = float(diff.norm()) / rn if rn > 0 else (0.0 if max_abs == 0 else math.inf)
        errs.append(OutputError(name, max_abs, max_rel, norm_rel, _cosine(r64, c64)))
    return errs


def collect(fn: Callable[..., Any], input_sets: Sequence[tuple[Any, ...]]) -> list[tuple[Any, Any, Any, Any]]:
    """Run ``fn`` for the gate: per input set ``(first copy, second copy, raw first output, later copy)``.

    Each set is called twice (the copies must agree). ``later`` is the raw first output copied again
    after *all* sets ran: if the candidate hands out a buffer it reuses (CUDA graphs, preallocated
    outputs), the next call overwrote it and ``later`` differs from ``first``.
    """
    rows = []
    with torch.inference_mode():
        for inputs in input_sets:
            raw = fn(*inputs)
            first = clone_outputs(raw)
            rows.append((first, clone_outputs(fn(*inputs)), raw))
        return [(f, s, r, clone_outputs(r)) for f, s, r in rows]


def judge(
    outputs: Sequence[tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], Any, list[tuple[str, Tensor]]]],
    references: Sequence[list[tuple[str, Tensor]]],
    tolerance: dict[str, float],
    *,
    metric_fn: Callable[[Any, Any], float] | None = None,
    metric_threshold: float | None = None,
    reference_raw: Sequence[Any] | None = None,
    rebuild: Callable[[list[Tensor]], Any] | None = None,
) -> GateResult:
    """The verdict on a candidate's outputs (two calls per held-out set) against eager's.

    ``rebuild`` turns flat tensors back into eager's structure for ``metric_fn`` when the raw
    output did not survive (candidates evaluated in a child process).
    """
    if len(outputs) != len(references):
        return GateResult(False, f"ran on {len(outputs)} input set(s), expected {len(references)}")
    worst = GateResult(passed=True, reason="")
    per_output: dict[str, OutputError] = {}
    metric_vals: list[float] = []
    for i, ((first, second, raw, later), ref) in enumerate(zip(outputs, references)):
        kept = compare_outputs(first, later)
        if isinstance(kept, str) or any(e.max_abs > 0 for e in kept):
            return GateResult(False, "an earlier output changed when the candidate was called again: it hands out a "
                              "reused buffer (copy outputs before returning them)")
        again = compare_outputs(first, second)
        if isinstance(again, str) or any(e.norm_rel > 1e-5 for e in again):
            return GateResult(False, "two calls on the same input disagree (a reused output buffer?)"
                              + (f": {again}" if isinstance(again, str) else ""))
        errs = compare_outputs(ref, first)
        if isinstance(errs, str):
            return GateResult(False, errs)
        for e in errs:
            w = per_output.get(e.name)
            if w is None:
                per_output[e.name] = e
            else:
                w.max_abs, w.max_rel = max(w.max_abs, e.max_abs), max(w.max_rel, e.max_rel)
                w.norm_rel, w.cosine = max(w.norm_rel, e.norm_rel), min(w.cosine, e.cosine)
        if metric_fn is not None:
            ref_obj = reference_raw[i] if reference_raw is not None else [t for _, t in ref]
            cand = raw if raw is not None else (rebuild([t for _, t in first]) if rebuild else [t for _, t in first])
            metric_vals.append(float(metric_fn(ref_obj, cand)))
    outs = list(per_output.values())
    worst.per_output = outs
    worst.max_abs = max((e.max_abs for e in outs), default=0.0)
    worst.max_rel = max((e.max_rel for e in outs), default=0.0)
    worst.norm_rel = max((e.norm_rel for e in outs), default=0.0)
    worst.min_cosine = min((e.cosine for e in outs), default=1.0)
    reasons = []
    if metric_fn is not None:  # the user's metric replaces the class tolerance
        tolerance = {}
    if "rel" in tolerance and not worst.norm_rel <= tolerance["rel"]:
        reasons.append(f"relative error {worst.norm_rel:.2e} > {tolerance['rel']:.0e}")
    if "abs" in tolerance and not worst.max_abs <= tolerance["abs"]:
        reasons.append(f"max abs error {worst.max_abs:.2e} > {tolerance['abs']:.0e}")
    if "cosine" in tolerance and not worst.min_cosine >= tolerance["cosine"]:
        reasons.append(f"cosine {worst.min_cosine:.5f} < {tolerance['cosine']}")
    if metric_vals:
        worst.metric = min(metric_vals)
        if metric_threshold is not None and not worst.metric >= metric_threshold:
            reasons.append(f"metric {worst.metric:.5f} < {metric_threshold}")
    if reasons:
        worst.passed, worst.reason = False, "; ".join(reasons)
    return worst
