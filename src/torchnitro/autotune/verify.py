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

**Padding.** When the inputs carry an attention mask (``mask_index``: a forward argument named
``attention_mask``, the second input of a token model, or the input the user names), outputs laid out
``(B, T, ...)`` like the mask are compared at the real positions only: what a model computes for a
padded query is ignored by every mask-aware pooling and head, and padding-free variants return zeros
there. ``GateResult.note`` says how many rows were compared; ``compare_padding`` compares all.

**Classifiers.** Outputs that look like class logits (``class_logits``: a 2-D ``(B, C)`` output named
``...logits``, or an unnamed 2-D ``(B, C)`` output, a plain tensor or a tuple entry, whose rows are not
unit vectors; a named output whose name does not end in ``logits``, such as HF's ``pooler_output``, is an
embedding, not class scores) also get top-1 and top-5
agreement with eager; the tolerance key ``top1`` (default 1.0 for the lossy classes) is the share of
rows whose top-1 class must not change, since a cosine of 0.999 can still flip a close call.
Token-level logits ``(B, T, V)`` are reported, and gated only with ``classifier=True``.

A candidate is called twice per input set and the copies must agree; and an output it returned must
not change when it is called again (a candidate handing out a reused buffer, as raw CUDA graphs do,
fails).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from torchnitro.autotune.inputs import _mask_in, forward_params, mask_index  # noqa: F401  (verify.mask_index)
from torchnitro.errors import ConfigError

__all__ = ["flatten_outputs", "OutputError", "GateResult", "compare_outputs", "collect", "judge", "clone_outputs",
           "mask_index", "padding_masks", "class_logits", "gate_options"]


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
    if is_dataclass(out) and not isinstance(out, type):  # a user's output dataclass: by field, as a dict
        return flatten_outputs({f.name: getattr(out, f.name) for f in fields(out)}, prefix)
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
    rows: int = 0  # rows (vectors along the last dim) compared
    total_rows: int = 0  # rows in the output; more than ``rows`` where masked positions were left out
    top1: float | None = None  # share of rows whose top-1 class agrees with eager (class logits only)
    top5: float | None = None  # share of rows whose eager top-1 class is in the candidate's top 5
    gated_top1: bool = False  # whether ``top1`` is part of the verdict (2-D class logits, or classifier=True)


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
    top1: float | None = None  # worst top-1 agreement over class-logit outputs (None: none)
    top5: float | None = None
    note: str = ""  # this candidate's class-logit agreement (top-1, top-5)
    compared: str = ""  # what the gate compared, the same for every candidate (masked positions left out)

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


def padding_masks(model: Any, input_sets: Sequence[tuple[Any, ...]], named: int | str | None = None,
                  compare_padding: bool = False) -> list[Tensor | None] | None:
    """The attention mask of each input set (for ``judge``), or None to compare every position.
    A feature-dict input (sentence-transformers) carries its mask under ``attention_mask``."""
    if compare_padding or not input_sets:
        return None
    i = mask_index(model, input_sets[0], named)
    if i is None:
        i = next((k for k, x in enumerate(input_sets[0]) if isinstance(x, Mapping) and _mask_in(x) is not None), None)
    if i is None:
        return None
    return [m.detach().cpu() if (m := _mask_in(s[i])) is not None else None for s in input_sets]


def gate_options(cfg: Any, model: Any, input_sets: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    """``judge``'s padding and classifier keywords from an ``OptimizeConfig`` (``padding_mask``,
    ``compare_padding``, ``classifier``) for ``model`` on ``input_sets``."""
    return {"masks": padding_masks(model, input_sets, getattr(cfg, "padding_mask", None),
                                   bool(getattr(cfg, "compare_padding", False))),
            "classifier": getattr(cfg, "classifier", None)}


def class_logits(name: str, ref: Tensor, classifier: bool | None = None) -> tuple[bool, bool]:
    """(report top-1 agreement, gate on it) for one output: see the module docstring."""
    if classifier is False or ref.dim() < 2 or ref.shape[-1] < 2 or not ref.is_floating_point():
        return False, False
    if bool((ref == ref.round()).all()):  # integer-valued: ids or a mask handed back (outputs arrive as fp32)
        return False, False
    if classifier:
        return True, True
    key = name.split(".")[-1]
    named = key.endswith("logits")
    if not named and re.sub(r"(_\d+)+$", "", key) != "output":
        # a named output that is not logits (HF's pooler_output, last_hidden_state, an embedding): its argmax
        # means nothing, and on a tanh-saturated pooler it flips between near-equal entries (coverage BERT)
        return False, False
    if ref.dim() == 2:
        unit = bool(((ref.double().norm(dim=1) - 1).abs() < 1e-3).all())  # L2-normalised embeddings
        return named or not unit, named or not unit
    return named, False


def _agreement(r: Tensor, c: Tensor) -> tuple[float, float]:
    """Top-1 and top-5 agreement over rows (last dim = classes); exact ties in eager count as agreeing."""
    r, c = r.reshape(-1, r.shape[-1]), c.reshape(-1, c.shape[-1])
    if r.shape[0] == 0:
        return 1.0, 1.0
    top = r.argmax(-1, keepdim=True)  # (rows, 1)
    pick = c.argmax(-1, keepdim=True)
    same = (pick == top) | (r.gather(-1, pick) == r.gather(-1, top))  # (rows, 1)
    in5 = (c.topk(min(5, c.shape[-1]), dim=-1).indices == top).any(-1)
    return float(same.float().mean()), float(in5.float().mean())


def _real_rows(r: Tensor, c: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Only the real positions of an output laid out ``(B, T, F...)`` like ``mask`` (B, T)."""
    if mask is None or r.dim() < 3 or tuple(r.shape[:2]) != tuple(mask.shape):
        return r, c
    keep = mask != 0
    return r[keep], c[keep]  # (N, F...)


def _rows(t: Tensor) -> int:
    return int(t.numel() // t.shape[-1]) if t.dim() >= 2 and t.shape[-1] else 1


def compare_outputs(ref: list[tuple[str, Tensor]], cand: list[tuple[str, Tensor]], mask: Tensor | None = None,
                    classifier: bool | None = None) -> list[OutputError] | str:
    """Per-output errors, or a string saying why the outputs cannot be compared. ``mask``: (B, T)
    attention mask; outputs laid out like it are compared at its nonzero positions only."""
    if len(ref) != len(cand):
        return f"returned {len(cand)} output tensor(s), eager returns {len(ref)}"
    errs = []
    for (name, r_all), (_, c_all) in zip(ref, cand):
        if tuple(r_all.shape) != tuple(c_all.shape):
            return f"output {name!r} has shape {tuple(c_all.shape)}, eager gives {tuple(r_all.shape)}"
        r, c = _real_rows(r_all, c_all, mask)
        r64, c64 = r.double(), c.double()
        if not torch.isfinite(c64).all() and torch.isfinite(r64).all():
            return f"output {name!r} has NaN/Inf where eager is finite"
        diff = (r64 - c64).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / (r64.abs() + 1e-6)).max()) if diff.numel() else 0.0
        rn = float(r64.norm())
        norm_rel = float(diff.norm()) / rn if rn > 0 else (0.0 if max_abs == 0 else math.inf)
        e = OutputError(name, max_abs, max_rel, norm_rel, _cosine(r64, c64), _rows(r), _rows(r_all))
        report, gated = class_logits(name, r_all, classifier)
        if report:
            e.top1, e.top5 = _agreement(r, c)
            e.gated_top1 = gated
        errs.append(e)
    return errs


def _sizes(inputs: tuple[Any, ...]) -> str:
    """'2x16, 2x16' for the tensors of one input set (in a feature dict too)."""
    from torch.utils._pytree import tree_leaves  # not recipes._layout's walker: that module imports this one

    return ", ".join("x".join(map(str, t.shape)) for t in tree_leaves(inputs) if isinstance(t, Tensor))


def _other_size(exc: Exception, first: tuple[Any, ...], inputs: tuple[Any, ...]) -> None:
    """Raise what the gate says when a candidate that ran on the first held-out set fails on one of another
    size: a graph that fixed a size of the example (an ONNX export tracing a reshape) fails exactly there,
    and the runtime's own message ("Non-zero status code returned while running Reshape node") does not say
    so. A time limit is left as it is."""
    from torchnitro.autotune.limits import timed_out

    a, b = _sizes(first), _sizes(inputs)
    if a != b and timed_out(exc) is None:
        raise RuntimeError(f"failed on a held-out set of another size ({b}) after running at {a}, as a variant that "
                           f"fixed a size of the example does: {type(exc).__name__}: {exc}") from exc


def collect(fn: Callable[..., Any], input_sets: Sequence[tuple[Any, ...]]) -> list[tuple[Any, Any, Any, Any]]:
    """Run ``fn`` for the gate: per input set ``(first copy, second copy, raw first output, later copy)``.

    Each set is called twice (the copies must agree). ``later`` is the raw first output copied again
    after *all* sets ran: if the candidate hands out a buffer it reuses (CUDA graphs, preallocated
    outputs), the next call overwrote it and ``later`` differs from ``first``.
    """
    rows = []
    with torch.inference_mode():
        for k, inputs in enumerate(input_sets):
            try:
                raw = fn(*inputs)
            except Exception as exc:
                if k:
                    _other_size(exc, input_sets[0], inputs)
                raise
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
    masks: Sequence[Tensor | None] | None = None,
    classifier: bool | None = None,
) -> GateResult:
    """The verdict on a candidate's outputs (two calls per held-out set) against eager's.

    ``rebuild`` turns flat tensors back into eager's structure for ``metric_fn`` when the raw
    output did not survive (candidates evaluated in a child process). ``masks``: each set's
    attention mask (``padding_masks``): masked positions are not compared. ``classifier``: None
    detects class logits, True treats every output as logits, False never.
    """
    if len(outputs) != len(references):
        return GateResult(False, f"ran on {len(outputs)} input set(s), expected {len(references)}")
    per_output: dict[str, OutputError] = {}
    metric_vals: list[float] = []
    for i, ((first, second, raw, later), ref) in enumerate(zip(outputs, references)):
        mask = masks[i] if masks is not None and i < len(masks) else None
        unstable = _stability_failure(first, second, later, mask)
        if unstable is not None:
            return unstable
        errs = compare_outputs(ref, first, mask, classifier)
        if isinstance(errs, str):
            return GateResult(False, errs)
        _merge_worst(per_output, errs)
        if metric_fn is not None:
            ref_obj = reference_raw[i] if reference_raw is not None else [t for _, t in ref]
            cand = raw if raw is not None else (rebuild([t for _, t in first]) if rebuild else [t for _, t in first])
            metric_vals.append(float(metric_fn(ref_obj, cand)))
    worst = _summary(list(per_output.values()))
    if metric_fn is not None:  # the user's metric replaces the class tolerance
        tolerance = {}
    reasons = _tolerance_failures(worst, tolerance)
    if metric_vals:
        worst.metric = min(metric_vals)
        if metric_threshold is not None and not worst.metric >= metric_threshold:
            reasons.append(f"metric {worst.metric:.5f} < {metric_threshold}")
    if reasons:
        worst.passed, worst.reason = False, "; ".join(reasons)
    return worst


def _stability_failure(first: list[tuple[str, Tensor]], second: list[tuple[str, Tensor]],
                       later: list[tuple[str, Tensor]], mask: Tensor | None) -> GateResult | None:
    """A failed GateResult when an output changed after a later call or two calls disagree, else None."""
    kept = compare_outputs(first, later, mask, False)
    if isinstance(kept, str) or any(e.max_abs > 0 for e in kept):
        return GateResult(False, "an earlier output changed when the candidate was called again: it hands out a "
                          "reused buffer (copy outputs before returning them)")
    again = compare_outputs(first, second, mask, False)
    if isinstance(again, str) or any(e.norm_rel > 1e-5 for e in again):
        return GateResult(False, "two calls on the same input disagree (a reused output buffer?)"
                          + (f": {again}" if isinstance(again, str) else ""))
    return None


def _merge_worst(per_output: dict[str, OutputError], errs: Sequence[OutputError]) -> None:
    """Fold one input set's errors into ``per_output``: the worst of each number, the rows summed."""
    for e in errs:
        w = per_output.get(e.name)
        if w is None:
            per_output[e.name] = e
            continue
        w.max_abs, w.max_rel = max(w.max_abs, e.max_abs), max(w.max_rel, e.max_rel)
        w.norm_rel, w.cosine = max(w.norm_rel, e.norm_rel), min(w.cosine, e.cosine)
        w.rows, w.total_rows = w.rows + e.rows, w.total_rows + e.total_rows
        if e.top1 is not None:
            w.top1 = e.top1 if w.top1 is None else min(w.top1, e.top1)
            w.top5 = e.top5 if w.top5 is None else min(w.top5, e.top5 or 1.0)


def _summary(outs: list[OutputError]) -> GateResult:
    """A passing GateResult holding the worst numbers over all outputs and the gate's notes."""
    worst = GateResult(passed=True, reason="")
    worst.per_output = outs
    worst.max_abs = max((e.max_abs for e in outs), default=0.0)
    worst.max_rel = max((e.max_rel for e in outs), default=0.0)
    worst.norm_rel = max((e.norm_rel for e in outs), default=0.0)
    worst.min_cosine = min((e.cosine for e in outs), default=1.0)
    logits = [e for e in outs if e.top1 is not None]
    worst.top1 = min((e.top1 for e in logits), default=None)
    worst.top5 = min((e.top5 for e in logits if e.top5 is not None), default=None)
    worst.compared, worst.note = _gate_notes(outs)
    return worst


def _tolerance_failures(worst: GateResult, tolerance: Mapping[str, float]) -> list[str]:
    """Why ``worst`` misses the class tolerance (rel, abs, cosine, classifier top-1), one reason each."""
    reasons = []
    if "rel" in tolerance and not worst.norm_rel <= tolerance["rel"]:
        reasons.append(f"relative error {worst.norm_rel:.2e} > {tolerance['rel']:.0e}")
    if "abs" in tolerance and not worst.max_abs <= tolerance["abs"]:
        reasons.append(f"max abs error {worst.max_abs:.2e} > {tolerance['abs']:.0e}")
    if "cosine" in tolerance and not worst.min_cosine >= tolerance["cosine"]:
        reasons.append(f"cosine {worst.min_cosine:.5f} < {tolerance['cosine']}")
    for e in worst.per_output:
        if e.top1 is not None and "top1" in tolerance and e.gated_top1 and not e.top1 >= tolerance["top1"]:
            reasons.append(f"top-1 class changed on {1 - e.top1:.1%} of the {e.rows} rows of {e.name!r} "
                           f"(agreement {e.top1:.4f} < {tolerance['top1']}; cosine {e.cosine:.5f})")
    return reasons


def _gate_notes(outs: Sequence[OutputError]) -> tuple[str, str]:
    """(which rows were compared: masked positions left out, the top-1/top-5 agreement) as one line each."""
    masked = [e for e in outs if e.rows < e.total_rows]
    compared = ""
    if masked:
        compared = ("gate compared real positions only: " + ", ".join(
            f"{e.rows} of {e.total_rows} rows of {e.name!r}" for e in masked)
            + " (masked positions left out; compare_padding=True compares all)")
    top = [f"{e.name!r} as class logits: top-1 agreement {e.top1:.4f}, top-5 {e.top5:.4f}"
           + ("" if e.gated_top1 else " (reported, not gated)") for e in outs if e.top1 is not None]
    return compared, "; ".join(top)
