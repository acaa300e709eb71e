"""The Linears an int8 plan kept out of int8, tried again in int8 with their outlier input channels in fp32.

``int8_mixed.plan_mixed_int8`` keeps the most sensitive Linears in bf16 (or fp32) until the calibration
cosine reaches the target. On all-MiniLM-L6-v2 those are FFN down-projections: their input (a GELU
output) has a handful of channels 4-17x the median channel's range, which set the per-tensor activation
scale and cost every other channel its resolution. With the channels above ``ratio`` x the median computed
in fp32 beside the int8 GEMM (``onednn_int8.Int8LinearBase``'s ``outliers``; LLM.int8's decomposition),
the rest quantise well, and the int8 GEMM plus a few fp32 columns costs about half a bf16 GEMM here
(results/bert_unpad_int8_profile.md).

The plan's own search leaves outlier channels off (``plan_mixed_int8``: a plan calibrated on short
sentences alone that relied on them missed long held-out text); here they are only a second chance for
the layers the plan already kept, each accepted only where the whole variant still reaches the plan's
calibration target on the same length-varied calibration sets, with the attention the build chose.
Even so, channels chosen on short sentences missed real long text: ``bert-unpad-int8`` calls this only
for examples of mostly full-length text (``bert_unpad.RETRY_MIN_REAL``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import Tensor, nn

__all__ = ["KEPT_RATIOS", "KEPT_FRACTION", "KeptRetry", "retry_kept_in_int8"]

# outlier thresholds tried (x the median channel's calibration max |x|), most fp32 channels first: with their
# product added in place they cost about the same as a few, and more of them held out better (all-MiniLM-L6-v2
# full length, held-out relative error 0.052 at 2.5x, 0.053 at 3x, 0.057 at 4x; results/bert_unpad_int8_profile.md)
KEPT_RATIOS = (2.5, 3.0, 4.0)
KEPT_FRACTION = 1 / 8  # at most this share of a layer's input channels runs in fp32


@dataclass
class KeptRetry:
    """The outcome: ``names`` moved into int8 with ``outliers`` (channel indices per Linear), the variant
    ``model`` and its calibration ``cosine``; ``names`` empty when none held the target."""

    names: list[str]
    outliers: dict[str, Tensor]
    model: nn.Module | None
    cosine: float | None
    note: str


def retry_kept_in_int8(base: nn.Module, kept: Sequence[str], calib: Sequence[tuple[Any, ...]], target: float,
                       make: Callable[[list[str], dict[str, Tensor]], nn.Module]) -> KeptRetry:
    """Try ``kept`` (Linears of ``base`` a plan kept out of int8) in int8 with outlier channels in fp32.

    ``make(names, outliers)``: the variant with ``names`` in int8 beyond the plan and ``outliers`` for
    them. All of ``kept`` at the first ratio of ``KEPT_RATIOS`` that reaches ``target``; where none
    does, one Linear at a time (the plan's order, most sensitive first, so from the end) at the ratio that
    came closest, each kept only while the target holds."""
    from torchnitro.autotune.recipes.int8_mixed import (_references, activation_absmax, calibration_cosine,
                                                       outlier_channels)

    kept = list(kept)
    if not kept:
        return KeptRetry([], {}, None, None, "")
    refs = _references(base, calib)
    amax = activation_absmax(base, calib, kept)
    tried: list[tuple[float, float]] = []
    for ratio in KEPT_RATIOS:
        outl = outlier_channels(amax, ratio, KEPT_FRACTION)
        q = make(kept, outl)
        cos = calibration_cosine(q, calib, refs)
        if cos >= target:
            return KeptRetry(kept, outl, q, cos, _note(kept, kept, ratio, cos))
        tried.append((cos, ratio))
    ratio = max(tried)[1]
    outl = outlier_channels(amax, ratio, KEPT_FRACTION)
    done: list[str] = []
    best: tuple[nn.Module, float] | None = None
    for n in reversed(kept):  # least sensitive first
        q = make(done + [n], {k: v for k, v in outl.items() if k in done + [n]})
        cos = calibration_cosine(q, calib, refs)
        if cos >= target:
            done.append(n)
            best = (q, cos)
    if best is None:
        worst = ", ".join(f"{r:g}x: {c:.4f}" for c, r in tried)
        return KeptRetry([], {}, None, None, f"kept Linears stay out of int8 (with outliers in fp32 at {worst} "
                                             f"< {target:.4f})")
    outl = {k: v for k, v in outl.items() if k in done}
    return KeptRetry(done, outl, best[0], best[1], _note(kept, done, ratio, best[1]))


def _note(kept: list[str], done: list[str], ratio: float, cos: float) -> str:
    return (f"{len(done)}/{len(kept)} kept Linears int8 with outlier inputs (> {ratio:g}x the median channel) "
            f"in fp32 (calibration cosine {cos:.4f})")
