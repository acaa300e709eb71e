"""Accuracy-aware mixed int8: quantise every Linear, but keep the layers the gate is sensitive to in fp32.

Per-tensor dynamic int8 of a whole transformer often fails the gate (MiniLM: cosine 0.936), because
a few layers (typically FFN down-projections with activation outliers) carry most of the error. As
accuracy-aware tuners do (Intel Neural Compressor's "fallback" strategy, ORT's ``nodes_to_exclude``):

1. ``layer_sensitivity``: quantise one Linear at a time (per-channel int8 weights, dynamic per-tensor
   activations, fbgemm/x86 VNNI kernels) and measure the worst per-row cosine of the model output
   against fp32 on calibration inputs;
   SmoothQuant first migrates activation outliers into the weights (``alpha`` = 0.75 by default);
2. ``plan_mixed_int8``: quantise all Linears, then move the most sensitive layer back to fp32, one at a
   time, until the worst cosine reaches ``target`` (the gate plus a margin) on the calibration inputs.

The calibration inputs are the search's timing inputs; the gate then checks held-out inputs.
The plan (which layers stay fp32) is stored in the artifact, so ``load`` re-quantises identically
without re-running the search.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._layout import tensor_leaves
from torchnitro.autotune.recipes._util import is_hf_conv1d, is_linear, linear_view
from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason
from torchnitro.autotune.recipes.quant import slow_path_transformer_layers_
from torchnitro.autotune.recipes.rowwise_int8 import RowwiseInt8Linear, rowwise_int8_reason
from torchnitro.errors import RecipeError
from torchnitro.hardware import HardwareInfo

__all__ = ["MixedInt8", "row_cosine", "layer_sensitivity", "plan_mixed_int8", "quantize_linears", "linear_names",
           "int8_unavailable_reason", "int8_target", "calibration_inputs", "SmoothedInt8Linear", "activation_absmax",
           "smooth_scales", "save_scales", "load_scales", "full_range_ok", "load_full_range", "outlier_channels",
           "load_outliers", "kept_module", "KEPT_PRECISIONS"]


def int8_unavailable_reason() -> str | None:
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm", "onednn")):
        return f"no x86 quantized engine in this torch build (engines: {engines})"
    return None


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every nn.Linear (and HF Conv1D, see ``_util.linear_view``), in module order."""
    return [n for n, m in model.named_modules() if is_linear(m)]



def _flat(out: Any) -> list[Tensor]:
    from torchnitro.autotune.verify import flatten_outputs

    return [t for _, t in flatten_outputs(out) if t.is_floating_point()]


def row_cosine(ref: Any, cand: Any) -> float:
    """Worst cosine over outputs and over rows (last dim = features): the sentence-embedding gate."""
    worst = 1.0
    for r, c in zip(_flat(ref), _flat(cand)):
        r2 = r.double().reshape(-1, r.shape[-1]) if r.dim() > 1 else r.double().reshape(1, -1)
        c2 = c.double().reshape(r2.shape)
        keep = r2.norm(dim=1) > 0  # rows that are exactly zero in fp32 (fully padded) carry no signal
        if keep.any():
            worst = min(worst, torch.nn.functional.cosine_similarity(r2[keep], c2[keep], dim=1).min().item())
    return worst


def _kept(out: Any) -> list[Tensor]:
    """The floating outputs copied: a model that returns the dict it was given (sentence-transformers)
    writes its next call's outputs into the same object, which would then be compared with itself."""
    return [t.detach().clone() for t in _flat(out)]


def _references(model: nn.Module, calib: Sequence[tuple[Any, ...]]) -> list[list[Tensor]]:
    with torch.inference_mode():
        return [_kept(model(*x)) for x in calib]


def calibration_cosine(model: nn.Module, calib: Sequence[tuple[Any, ...]], refs: Sequence[Any]) -> float:
    with torch.inference_mode():
        return min(row_cosine(r, model(*x)) for x, r in zip(calib, refs))


def full_range_ok() -> bool:
    """8-bit activations are exact in fbgemm only with VNNI/AMX dot products (no int16 saturation);
    without them torch's default 7-bit activation range ("reduce_range") is needed."""
    from torchnitro.hardware import hardware_info

    return hardware_info().cpu_vnni


def _full_range_linear_cls() -> type:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear

    class FullRangeDynamicLinear(DynamicQuantLinear):
        """Dynamic int8 Linear with 8-bit (not 7-bit) activation quantisation: twice the resolution,
        same speed on VNNI CPUs. Lets MiniLM keep every Linear in int8 (cosine 0.997 vs 0.993)."""

        def forward(self, x: Tensor) -> Tensor:
            return torch.ops.quantized.linear_dynamic(x, self._packed_params._packed_params,
                                                      reduce_range=False).to(x.dtype)

    return FullRangeDynamicLinear


def _quantized_module(lin: nn.Linear, full_range: bool = False) -> nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    lin.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            q = DynamicQuantLinear.from_float(lin)
        finally:
            del lin.qconfig
    if full_range:
        q.__class__ = _FULL_RANGE
    return q


_FULL_RANGE = _full_range_linear_cls()


def load_full_range(meta: dict[str, Any]) -> bool:
    """The artifact's activation range, if this machine can run it; else warn once and use 7 bits."""
    if meta.get("full_range") and not full_range_ok():
        warnings.warn("this int8 artifact was tuned with 8-bit activations (VNNI); this CPU has no VNNI, so it "
                      "runs with 7-bit activations and may score slightly lower on the gate", stacklevel=2)
        return False
    return bool(meta.get("full_range"))


class SmoothedInt8Linear(nn.Module):
    """``y = int8_linear(x / s)`` with ``W * s`` quantised: SmoothQuant (Xiao et al., 2023) moves
    per-input-channel activation outliers into the weights, where per-channel scales absorb them."""

    def __init__(self, lin: nn.Linear, scale: Tensor, full_range: bool = False):
        super().__init__()
        self.register_buffer("inv_scale", (1.0 / scale).to(lin.weight.dtype))  # (in_features,)
        moved = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        with torch.no_grad():
            moved.weight.copy_(lin.weight * scale)  # (out, in) * (in,)
            if lin.bias is not None:
                moved.bias.copy_(lin.bias)
        self.q = _quantized_module(moved, full_range)

    inplace = False  # set by callers that pass a temporary input: saves an allocation per call

    def forward(self, x: Tensor) -> Tensor:
        return self.q(x.mul_(self.inv_scale) if self.inplace else x * self.inv_scale)


def activation_absmax(model: nn.Module, calib: Sequence[tuple[Any, ...]], names: Sequence[str],
                      outputs: list[list[Tensor]] | None = None) -> dict[str, Tensor]:
    """Per-input-channel max |x| seen by each Linear on the calibration inputs; ``outputs``: a list the
    model's (copied) outputs on them are appended to, so the references cost no forwards of their own."""
    amax: dict[str, Tensor] = {}
    if any(isinstance(m, nn.TransformerEncoderLayer) for m in model.modules()):
        # a hooked Linear keeps its TransformerEncoderLayer off the fused path, while the encoder would still
        # hand that layer a nested tensor (padded batches): calibrate a copy that runs the slow path throughout
        model = copy.deepcopy(model)
        slow_path_transformer_layers_(model, names)

    def hook(name: str):
        def fn(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
            a = inp[0].detach().abs().reshape(-1, inp[0].shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return fn

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.inference_mode():
            for x in calib:
                out = model(*x)
                if outputs is not None:
                    outputs.append(_kept(out))
    finally:
        for h in handles:
            h.remove()
    return amax


def smooth_scales(model: nn.Module, amax: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) per input channel j (SmoothQuant eq. 4)."""
    out = {}
    for n, a in amax.items():
        w = model.get_submodule(n).weight.detach().abs().amax(0).float().clamp(min=1e-5)
        out[n] = (a.clamp(min=1e-5) ** alpha / w ** (1.0 - alpha)).clamp(min=1e-5)
    return out


OUTLIER_RATIO = 8.0  # a channel whose calibration max |x| is this many times the median channel's is an outlier
OUTLIER_FRACTION = 1 / 64  # at most this share of a layer's input channels (at least one) runs in fp32


def outlier_channels(amax: dict[str, Tensor], ratio: float = OUTLIER_RATIO,
                     fraction: float = OUTLIER_FRACTION) -> dict[str, Tensor]:
    """Per Linear, the input channels whose calibration ``max |x|`` exceeds ``ratio`` times the median
    channel's (largest first, at most ``fraction`` of the channels): computed in fp32 beside the int8
    GEMM (``onednn_int8.Int8LinearBase``). Layers without such channels are left out."""
    out = {}
    for n, a in amax.items():
        a = a.float().reshape(-1)
        big = torch.nonzero(a > ratio * a.median().clamp(min=1e-12)).reshape(-1)
        if big.numel():
            keep = max(1, int(a.numel() * fraction))
            big = big[a[big].argsort(descending=True)[:keep]]
            out[n] = big.sort().values
    return out


def int8_module(lin: nn.Linear, scale: Tensor | None, full_range: bool = False, engine: str = "fbgemm",
                outliers: Tensor | None = None) -> nn.Module:
    """``lin`` in int8, smoothed by ``scale``: ``rowwise`` (a scale per token row, see rowwise_int8),
    ``fbgemm`` (PyTorch's dynamic int8 Linear) or ``onednn`` (the fused oneDNN kernel, 8-bit
    activations, see onednn_int8); the last two quantise activations per tensor. ``outliers``: input
    channels kept in fp32 beside the int8 GEMM (``rowwise`` and ``onednn`` only; fbgemm ignores them)."""
    if engine == "rowwise":
        return RowwiseInt8Linear(lin, scale, outliers)
    if engine == "onednn":
        return OneDnnInt8Linear(lin, scale, outliers)
    if engine != "fbgemm":
        raise ValueError(f"int8 engine {engine!r}; expected one of {INT8_ENGINES}")
    return _quantized_module(lin, full_range) if scale is None else SmoothedInt8Linear(lin, scale, full_range)


INT8_ENGINES = ("onednn", "rowwise", "fbgemm")  # tried in this order: fastest per GEMM first (docs/optimize.md)


def _engine_reasons() -> dict[str, str | None]:
    why = {"onednn": onednn_int8_reason(), "rowwise": rowwise_int8_reason(), "fbgemm": None}
    return {e: why[e] for e in INT8_ENGINES}


def build_mixed_int8(ctx: BuildContext, model: nn.Module, make: Callable[..., nn.Module],
                     kept: Sequence[str] = ("fp32",)) -> tuple[nn.Module, dict[str, Any], str]:
    """The int8 recipes' build: for each engine of ``INT8_ENGINES`` that runs here, plan on ``model``
    with that engine's own Linears (SmoothQuant scales) on length-varied calibration sets,
    ``make(plan, engine)``, and keep the first whose variant reaches the target there (oneDNN's
    per-tensor rounding differs from per-token's and fbgemm's). ``kept``: the precisions tried in order
    for the Linears the plan keeps out of int8 (``kept_module``; ``make(plan, engine, precision)`` with
    more than one), each planned with that precision in place (``_plan_engine``), before the next engine:
    all-MiniLM-L6-v2 on full-length text needs three FFN down-projections out of int8 in fp32, and two
    more Linears with them in bf16 (bf16 rounding costs 0.002 of calibration cosine), for less time than
    the three in fp32 (results/encoder_full_length.md); on short sentences two in bf16 suffice, as in fp32.
    Saves the scales in the workdir. Returns (variant, artifact meta with ``kept``, "engine[: why not the
    engines before it]")."""
    calib, target = varied_calibration_inputs(ctx), int8_target(ctx)
    skipped: list[str] = []
    for engine, why in _engine_reasons().items():
        if why is not None:
            skipped.append(f"{engine}: {why}")
            continue
        try:
            q, plan, cos = _plan_engine(model, calib, target, engine, kept, make)
        except RecipeError as exc:
            if engine == INT8_ENGINES[-1]:
                raise
            skipped.append(f"{engine}: {exc}")
            continue
        if cos >= target or engine == INT8_ENGINES[-1]:
            break
        skipped.append(f"{engine}: calibration cosine {cos:.4f} < {target:.4f}")
    save_scales(plan["scales"], ctx.workdir / "smooth_scales.safetensors")
    meta = {"int8": plan["int8"], "fp32": plan["fp32"], "calib_cosine": cos, "full_range": plan["full_range"],
            "alpha": plan["alpha"], "kept": plan["kept"],
            "engine": engine, "outliers": {n: [int(i) for i in v] for n, v in plan["outliers"].items()}}
    return q, meta, f"{engine}: {'; '.join(skipped)}" if skipped else engine


def _plan_engine(model: nn.Module, calib: Sequence[tuple[Any, ...]], target: float, engine: str,
                 kept: Sequence[str], make: Callable[..., nn.Module]) -> tuple[nn.Module, dict[str, Any], float]:
    """One engine's variant. The layers are ranked and planned in the last (most accurate) ``kept``
    precision; each precision before it takes that plan's layers, and when that misses ``target`` goes
    on from the plan (more layers down the same ranking as it needs): the first variant that reaches
    ``target`` is returned, else the last's. A
    model that needs no layer kept out of int8 at all gets that plan whatever the precisions.
    Raises RecipeError when the most accurate precision cannot plan."""
    if not kept:
        raise RecipeError(f"mixed int8: no kept precision given; expected some of {KEPT_PRECISIONS}")
    first = plan_mixed_int8(model, calib, target, engine=engine, kept=kept[-1])
    for k in kept:
        plan = first
        if k != kept[-1] and first["fp32"]:
            plan = dict(first, kept=k)  # the same layers in k first: the fewest kept when that reaches the target
            q = make(plan, engine, k)
            cos = calibration_cosine(q, calib, plan["refs"])
            if cos >= target:
                break
            try:
                plan = plan_mixed_int8(model, calib, target, engine=engine, kept=k, start=first, start_cosine=cos)
            except RecipeError:
                continue  # this precision needs more layers kept than allowed: the next one
        q = make(plan, engine, k) if len(kept) > 1 else make(plan, engine)
        cos = calibration_cosine(q, calib, plan["refs"])
        if cos >= target or not plan["fp32"]:  # nothing kept out of int8: the precisions agree
            break
    return q, plan, cos


def load_engine(meta: dict[str, Any], recipe: str) -> str:
    """The artifact's int8 engine, if it runs here; else warn and use fbgemm (same plan)."""
    engine = meta.get("engine", "fbgemm")
    why = {"onednn": onednn_int8_reason, "rowwise": rowwise_int8_reason}.get(engine, lambda: None)()
    if why is not None:
        warnings.warn(f"this {recipe} artifact was tuned on {engine} int8 kernels, which do not run here "
                      f"({why}); loading it on fbgemm's dynamic int8 Linear instead (same plan, slightly different "
                      "rounding)", stacklevel=3)
        return "fbgemm"
    return engine


def quantize_linears(model: nn.Module, names: Sequence[str], scales: dict[str, Tensor] | None = None,
                     full_range: bool = False, engine: str = "fbgemm",
                     outliers: dict[str, Tensor] | None = None) -> nn.Module:
    """A copy of ``model`` with the Linears ``names`` in dynamic int8 (per-channel weights), smoothed
    with ``scales[name]`` where given; ``full_range``: 8-bit activations (VNNI CPUs only);
    ``outliers[name]``: input channels kept in fp32 (``outlier_channels``)."""
    q = copy.deepcopy(model).eval()
    scales, outliers = scales or {}, outliers or {}
    for n in names:
        q.set_submodule(n, int8_module(q.get_submodule(n), scales.get(n), full_range, engine, outliers.get(n)))
    slow_path_transformer_layers_(q)  # nn.TransformerEncoderLayer's fused path needs float Linears
    return q


def load_outliers(meta: dict[str, Any]) -> dict[str, Tensor]:
    """The artifact's fp32 outlier channels per Linear (none in artifacts made before they existed)."""
    return {n: torch.tensor(v, dtype=torch.long) for n, v in (meta.get("outliers") or {}).items()}


KEPT_PRECISIONS = ("bf16", "fp32")  # what a Linear kept out of int8 may compute in


def kept_module(lin: nn.Module, kept: str) -> nn.Module:
    """``lin`` as a Linear kept out of int8 computes: itself (``fp32``), or a prepacked oneDNN bf16
    GEMM with fp32 in and out (``bf16``; CPU fp32 ``nn.Linear`` only, anything else stays as it is)."""
    if kept not in KEPT_PRECISIONS:
        raise ValueError(f"kept precision {kept!r}; expected one of {KEPT_PRECISIONS}")
    if kept == "fp32" or type(lin) is not nn.Linear or lin.weight.dtype != torch.float32 or lin.weight.is_cuda:
        return lin
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear

    return Bf16ComputeLinear(lin)


class _Swapper:
    """Swaps single Linears of a private copy between their kept precision (``kept_module``) and int8
    in place (no copy per trial)."""

    def __init__(self, model: nn.Module, names: Sequence[str], scales: dict[str, Tensor], full_range: bool,
                 engine: str = "fbgemm", outliers: dict[str, Tensor] | None = None, kept: str = "fp32"):
        self.model = copy.deepcopy(model).eval()
        slow_path_transformer_layers_(self.model, names)  # any of them may be swapped to int8 below
        fp32 = {n: self.model.get_submodule(n) for n in names}
        self.off = {n: kept_module(fp32[n], kept) for n in names}
        outliers = outliers or {}
        self.int8 = {n: int8_module(fp32[n], scales.get(n), full_range, engine, outliers.get(n)) for n in names}

    def set(self, name: str, int8: bool) -> None:
        self.model.set_submodule(name, self.int8[name] if int8 else self.off[name])


def _sens(sw: _Swapper, names: Sequence[str], calib: Sequence[tuple[Any, ...]], refs: Sequence[Any]) -> dict[str, float]:
    out = {}
    for n in names:
        sw.set(n, True)
        out[n] = 1.0 - calibration_cosine(sw.model, calib, refs)
        sw.set(n, False)
    return out


def _rows(x: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    return tuple(t[:k] if isinstance(t, Tensor) and t.dim() else t for t in x)


def layer_sensitivity(model: nn.Module, calib: Sequence[tuple[Any, ...]], names: Sequence[str] | None = None,
                      scales: dict[str, Tensor] | None = None, full_range: bool = False) -> dict[str, float]:
    """Cosine loss (1 - worst row cosine) when only that Linear is int8; larger = more sensitive."""
    names = list(names) if names is not None else linear_names(model)
    refs = _references(model, calib)
    return _sens(_Swapper(model, names, scales or {}, full_range), names, calib, refs)


def plan_mixed_int8(model: nn.Module, calib: Sequence[tuple[Any, ...]], target: float, *,
                    names: Sequence[str] | None = None, alpha: float | None = 0.75,
                    max_fp32_fraction: float = 0.5, sensitivity_rows: int = 8,
                    full_range: bool | None = None, engine: str = "fbgemm", outliers: bool = False,
                    kept: str = "fp32", start: dict[str, Any] | None = None,
                    start_cosine: float | None = None) -> dict[str, Any]:
    """Pick the Linears to keep out of int8 (in ``kept`` precision, see ``kept_module``) so the worst
    calibration cosine is >= ``target``.

    ``alpha`` is the SmoothQuant migration strength (None: no smoothing; a strength picked per model on
    the calibration sets did not carry over to other text: see ``outliers``). Returns ``{"int8": [...],
    "fp32": [...], "cosine": float, "sensitivity": {...}, "scales": {...}, "full_range": bool,
    "refs": [...]}`` (``refs``: the model's outputs on ``calib``); raises
    RecipeError when more than ``max_fp32_fraction`` of the layers would have to stay fp32.
    ``full_range`` (8-bit activations) defaults to whether this CPU has VNNI; ``engine``: the int8
    Linear the plan is measured on (see ``int8_module``); ``outliers``: keep each Linear's outlier input
    channels in fp32 beside its int8 GEMM (``outlier_channels``; the ``onednn`` and ``rowwise`` engines),
    returned as ``"outliers"``. Off by default: on all-MiniLM-L6-v2 they let every Linear pass calibration
    on short sentences (0.9959) and the variant then scored 0.982 on real long text, where the plan
    without them (two FFN down-projections kept fp32) holds 0.99 (results/optimize_user_models.md).
    The layers kept out of int8 are returned as ``"fp32"`` whatever ``kept`` is (returned as ``"kept"``).
    ``start``: a plan of the same model on the same calibration sets (another ``kept`` precision) to go on
    from: its sensitivity ranking, references and activation ranges (the same forwards would give them
    again: a tenth of a full-length MiniLM build), its kept layers first, more
    down the ranking as this precision needs. ``start_cosine``: the calibration cosine already measured
    with ``start``'s layers kept in this precision, so it is not measured again.
    """
    full_range = full_range_ok() if full_range is None else full_range
    names = list(names) if names is not None else linear_names(model)
    if not names:
        raise RecipeError("mixed int8: the model has no nn.Linear layers; expected at least one to quantise")
    if start is not None and start.get("names") == names:  # (a Linear that never runs has no range)
        refs, amax = start["refs"], start["amax"]
    else:
        refs = []
        amax = activation_absmax(model, calib, names, refs)  # the references come from the same forwards
    split = outlier_channels(amax) if outliers and engine in ("onednn", "rowwise") else {}
    scales = smooth_scales(model, amax, alpha) if alpha is not None else {}
    sw = _Swapper(model, names, scales, full_range, engine, split, kept)
    for n in names:
        sw.set(n, True)
    cos: float | None = None
    sens: dict[str, float] = dict(start["sensitivity"]) if start is not None else {}
    if start is None:
        cos = calibration_cosine(sw.model, calib, refs)
    if start is None and cos < target:  # rank layers on a slice of the calibration batch: one forward per layer
        for n in names:
            sw.set(n, False)
        small = [_rows(x, sensitivity_rows) for x in calib]
        small_refs = _references(model, small)
        sens = _sens(sw, names, small, small_refs)
        for n in names:
            sw.set(n, True)
    order = sorted(names, key=lambda n: sens.get(n, 0.0), reverse=True)  # most sensitive first
    fp32: list[str] = [n for n in order if n in start["fp32"]] if start is not None else []
    for n in fp32:
        sw.set(n, False)
    known = start_cosine if start is not None else cos  # the cosine of the layers as they are set, if measured
    while True:
        cos = calibration_cosine(sw.model, calib, refs) if known is None else known
        known = None
        if cos >= target:
            int8 = [n for n in names if n not in fp32]
            return {"int8": int8, "fp32": fp32, "kept": kept, "cosine": cos, "sensitivity": sens,
                    "full_range": full_range,
                    "scales": {n: scales[n] for n in int8 if n in scales}, "refs": refs, "amax": amax, "names": names,
                    "alpha": alpha,
                    "outliers": {n: split[n] for n in int8 if n in split}}
        if len(fp32) + 1 > max_fp32_fraction * len(names):
            raise RecipeError(
                f"mixed int8: with {len(fp32)}/{len(names)} layers kept in {kept} the calibration cosine is {cos:.5f}, "
                f"expected >= {target}; int8 does not suit this model (use a bf16 recipe), or lower the int8 gate")
        fp32.append(order[len(fp32)])
        sw.set(fp32[-1], False)


def save_scales(scales: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in scales.items()}, str(path))


def load_scales(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.is_file() else {}


def calibration_inputs(ctx: BuildContext, max_rows: int = 32) -> list[tuple[Any, ...]]:
    """The timing inputs cut to ``max_rows`` along the batch dim (when it is declared dynamic):
    the plan costs a few forwards of this batch."""
    xs = ctx.example_inputs
    if not all(0 in ctx.dynamic_dims.get(i, []) for i, x in enumerate(xs) if isinstance(x, Tensor)):
        return [xs]
    return [tuple(x[:max_rows] if isinstance(x, Tensor) and x.dim() else x for x in xs)]


def varied_calibration_inputs(ctx: BuildContext, extra: int = 2) -> list[tuple[Any, ...]]:
    """``calibration_inputs`` plus, for text (a right-padded attention mask among the inputs, or in a
    feature dict), ``extra`` sets with other sentence lengths drawn from the example's own tokens
    (``inputs.random_like``, seeds apart from the gate's): an int8 plan fitted to one batch of short
    sentences alone passed it at 0.9944 and failed longer held-out text at 0.986 (all-MiniLM-L6-v2,
    worst token row)."""
    from torchnitro.autotune.inputs import _is_prefix_mask, random_like

    base = calibration_inputs(ctx)
    if not any(_is_prefix_mask(x) for x in tensor_leaves(base[0])):  # a feature dict's mask too
        return base
    return base + [random_like(base[0], _CALIB_SEED + k) for k in range(extra)]


_CALIB_SEED = 7919  # far from the gate's held-out seeds (OptimizeConfig.seed = 1234 + a few)


def int8_target(ctx: BuildContext, margin: float = 0.004) -> float:
    """The int8 gate's cosine from the search config, plus a margin for held-out inputs."""
    cos = 0.99
    if ctx.config is not None and hasattr(ctx.config, "tolerance"):
        cos = float(ctx.config.tolerance("int8").get("cosine", cos))
    return min(0.99999, cos + margin)


@register_recipe
class MixedInt8(Recipe):
    name = "int8-mixed"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.INT8
    description = "dynamic int8 Linears (per-channel, VNNI) with the most gate-sensitive layers kept in fp32"
    order = 46
    version = "5"  # 2: fused oneDNN int8 Linear; 3: HF Conv1D quantised as Linear; 4: per-token int8 (rowwise);
    # 5: a model returning its input dict is planned against copied references, on varied lengths

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return int8_unavailable_reason()

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not linear_names(model):
            return "no nn.Linear layers"
        if any(isinstance(x, Tensor) and x.is_cuda for x in example_inputs):
            return "dynamic int8 kernels run on the CPU only"
        return None

    def build(self, ctx: BuildContext) -> Built:
        n_conv1d = sum(1 for m in ctx.model.modules() if is_hf_conv1d(m))
        model = linear_view(ctx.model)  # GPT-2's Conv1D as the Linear it is
        q, meta, engine = build_mixed_int8(
            ctx, model, lambda plan, e: quantize_linears(model, plan["int8"], plan["scales"], plan["full_range"], e,
                                                         plan["outliers"]))
        return Built(fn=q, files=["smooth_scales.safetensors"], meta=meta,
                     notes=f"{len(meta['int8'])} Linear int8 ({engine}), {len(meta['fp32'])} kept fp32 "
                           f"(calibration cosine {meta['calib_cosine']:.4f})"
                           + (f"; {n_conv1d} HF Conv1D taken as Linear" if n_conv1d else ""))

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = linear_view(self.require_model(model).eval())
        return quantize_linears(model, meta["int8"], load_scales(directory / "smooth_scales.safetensors"),
                                load_full_range(meta), load_engine(meta, self.name), load_outliers(meta))
