"""Padding-free BERT-family encoders as recipes: compute only on real tokens.

Sentence-embedding and classification workloads pad every sentence of a batch to one length; eager
BERT spends its GEMMs on the padding too. These recipes run the encoder on the packed real tokens
(``_unpad``: fused QKV GEMM, length-bucketed attention, FFN row blocks):

- ``torchnitro.hf.SentenceEncoder``: ``UnpaddedBert``, with mean pooling on the packed rows;
- any other model: every HF encoder of the BERT family in its module tree (a user's wrapper class,
  ``AutoModel.from_pretrained`` given directly, a task head) is replaced in place by
  ``hf_encoders.UnpaddedEncoder``, which keeps the HF signature and output type and returns zeros
  at masked positions of ``last_hidden_state`` (see that module).

Real tokens see the same computation as in eager, so the fp32 variant is an EXACT recipe; how much it
saves is the padding fraction of the inputs (measured, never assumed). The int8 variant adds
SmoothQuant + accuracy-aware mixed int8 (``int8_mixed``) to the Linears; the bf16 variant computes
the encoder in bf16 and hands fp32 on.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._native_attention import native_computes
from torchnitro.autotune.recipes._unpad import PackedLayer
from torchnitro.autotune.recipes.hf_encoders import UnpaddedEncoder, encoders_reason, unpad_encoders_
from torchnitro.autotune.recipes.int8_mixed import (build_mixed_int8, int8_unavailable_reason, linear_names,
                                                   load_engine, load_full_range, load_outliers, load_scales,
                                                   quantize_linears)
from torchnitro.autotune.recipes.onednn_int8 import Int8LinearBase
from torchnitro.kernels.cpu_int8 import cpu_int8_reason

__all__ = ["UnpaddedBert", "fold_smoothing", "bert_inapplicable_reason", "unpad_model", "UnpaddedBertRecipe",
           "UnpaddedBertInt8", "UnpaddedBertBf16"]


class UnpaddedBert(UnpaddedEncoder):
    """``SentenceEncoder`` -> ``(input_ids, attention_mask) -> (B, D)`` normalised mean-pooled
    embeddings, on real tokens only; the pooling reads the packed rows (no ``(B, T, D)`` multiply)."""

    def __init__(self, sentence_encoder: nn.Module):
        super().__init__(sentence_encoder.encoder)
        self.normalize = bool(getattr(sentence_encoder, "normalize", True))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # type: ignore[override]
        b, t = input_ids.shape
        x, p = self.packed(input_ids, attention_mask)
        summed = p.scatter(x.float(), b, t).sum(1)  # (B, D); pooled in fp32 whatever the compute dtype
        count = attention_mask.sum(1, keepdim=True).to(summed.dtype).clamp(min=1e-9)  # (B, 1)
        emb = summed / count
        return F.normalize(emb, p=2.0, dim=1) if self.normalize else emb


def _scale_out(mod: nn.Module, s: Tensor) -> None:
    """``mod`` (a LayerNorm, or ELECTRA's embedding projection Linear) emits its output divided by ``s``."""
    with torch.no_grad():
        mod.weight.div_(s[:, None] if mod.weight.dim() == 2 else s)  # Linear: (out, in) rows
        mod.bias.div_(s)


def _own(holder: nn.Module, attr: str) -> nn.Module:
    """``holder.attr`` replaced by a private copy, which is returned: an in-place encoder shares its
    LayerNorms and Linears with the original HF module it falls back to, which must stay unscaled."""
    mod = copy.deepcopy(getattr(holder, attr))
    setattr(holder, attr, mod)
    return mod


def _fold_one(m: UnpaddedEncoder, left: dict[str, Tensor], prefix: str, norms: bool) -> None:
    # the module feeding the next qkv: (holder, attribute); ELECTRA's embedding projection, else a LayerNorm
    prev = (m, "project") if getattr(m, "project", None) is not None else (m, "ln_emb")
    for i, layer in enumerate(m.layers):
        d = layer.out.in_features
        s = left.pop(f"{prefix}layers.{i}.out", None)
        if s is not None:
            with torch.no_grad():
                layer.qkv.weight[2 * d:] /= s[:, None]  # V rows: ctx comes out divided by s (qkv is private)
                layer.qkv.bias[2 * d:] /= s
                _own(layer, "out").weight *= s  # columns: out(ctx / s) with W * s == out(ctx)
        s = left.pop(f"{prefix}layers.{i}.qkv", None) if norms else None
        if s is not None:
            _scale_out(_own(*prev), s)
            with torch.no_grad():
                layer.qkv.weight *= s
            layer.res_in = s  # the previous LayerNorm now emits x / s; only this layer reads it
        s = left.pop(f"{prefix}layers.{i}.ffn_in", None) if norms else None
        if s is not None:
            _scale_out(_own(layer, "ln1"), s)
            with torch.no_grad():
                _own(layer, "ffn_in").weight *= s
            layer.res_mid = s
        prev = (layer, "ln2")


def fold_smoothing(base: nn.Module, scales: dict[str, Tensor], norms: bool = True) -> tuple[nn.Module,
                                                                                            dict[str, Tensor]]:
    """A copy of ``base`` with SmoothQuant scales folded into weights where that is exact, so the
    int8 Linears need no ``x / s`` multiply: the attention output's scale goes into the V rows of
    qkv (attention is linear in V), qkv's and ffn_in's into the LayerNorm (or ELECTRA's embedding
    projection) that feeds them (its residual becomes ``addcmul``) unless ``norms`` is False: where
    the int8 Linear smooths for free in its quantisation pass (``onednn_int8`` on the native quantiser),
    the LayerNorm's output stays the residual as it is and no ``x * s`` pass is needed. Returns the
    copy and the scales still to apply at run time.

    An in-place ``UnpaddedEncoder`` shares its LayerNorms and Linears with the original module it
    falls back to; each one a scale is folded into is first replaced by a private copy (LayerNorms:
    a few KB; a Linear is quantised right after, so its fp32 copy is dropped), so the fallback stays exact."""
    m = copy.deepcopy(base)
    left = dict(scales)
    for name, sub in list(m.named_modules()):
        if isinstance(sub, UnpaddedEncoder):
            _fold_one(sub, left, f"{name}." if name else "", norms)
    return m, left


def _int8(base: nn.Module, names: list[str], scales: dict[str, Tensor], full_range: bool,
          engine: str = "fbgemm", outliers: dict[str, Tensor] | None = None, bf16_rest: bool = False) -> nn.Module:
    """``base`` with the Linears ``names`` in int8. ``onednn``: fused oneDNN kernels that smooth in the
    activation quantisation and take GELU / the residual add into the GEMM epilogue; ``fbgemm``:
    PyTorch's dynamic int8 Linear with the smoothing folded into the weights where exact."""
    from torchnitro.autotune.recipes.int8_mixed import SmoothedInt8Linear

    folded, left = fold_smoothing(base, scales, norms=not (engine == "onednn" and cpu_int8_reason() is None))
    q = quantize_linears(folded, names, left, full_range, engine, outliers)
    for layer in q.modules():
        if isinstance(layer, PackedLayer) and isinstance(layer.ffn_out, (SmoothedInt8Linear, Int8LinearBase)):
            layer.ffn_out.inplace = True  # its input is the GELU temporary
    if bf16_rest:
        from torchnitro.autotune.recipes.onednn_bf16 import bf16_compute_, chain_bf16_

        bf16_compute_(q)
        chain_bf16_(q)  # a bf16 FFN down-projection reads its up-projection's output as bf16, written so
    return q


def _graph_attention_(ctx: BuildContext, base: nn.Module, q: nn.Module, meta: dict[str, Any]) -> str:
    """Switch ``q``'s attention of batches without padding to the fused bf16 kernel (``_graph_attention``)
    when it runs here, engages on a calibration set and keeps the calibration cosine at the target;
    records the outcome in ``meta`` and returns a note."""
    from torchnitro.autotune.recipes._graph_attention import (GraphAttention, enable_graph_attention_,
                                                              graph_attention_reason)
    from torchnitro.autotune.recipes.int8_mixed import (_references, calibration_cosine, int8_target,
                                                       varied_calibration_inputs)

    meta["graph_attention"] = False
    why = graph_attention_reason()
    if why is not None:
        return f"attention: SDPA ({why})"
    enable_graph_attention_(q)
    calib, target = varied_calibration_inputs(ctx), int8_target(ctx)
    cos = calibration_cosine(q, calib, _references(base, calib))
    gas = [m.graph_attention for m in q.modules() if isinstance(m, PackedLayer)]
    failed = next((g.failed for g in gas if isinstance(g, GraphAttention) and g.failed), None)
    used = any(isinstance(g, GraphAttention) and g._graphs for g in gas)
    if failed or not used or cos < target:
        enable_graph_attention_(q, on=False)
        return "attention: SDPA (fused bf16 attention " + (
            f"failed: {failed})" if failed else "not engaged: every calibration set has padding)" if not used
            else f"kept calibration cosine {cos:.4f} < {target:.4f})")
    meta["graph_attention"], meta["calib_cosine"] = True, cos
    return "attention without padding: fused bf16 (oneDNN Graph)"


def _choose_attention(ctx: BuildContext, m: nn.Module, computes: tuple[str, ...], meta: dict[str, Any],
                      accept: Callable[[], str | None] | None = None) -> str:
    """Native varlen attention for ``m`` where it runs, agrees and is faster on the example (else SDPA);
    records it in ``meta`` and returns the note (``_native_attention.choose_attention_``)."""
    from torchnitro.autotune.recipes._native_attention import choose_attention_

    choice = choose_attention_(m, tuple(ctx.example_inputs), computes, accept)
    meta["native_attention"] = choice.compute
    return choice.note


def _native_on_load(m: nn.Module, meta: dict[str, Any]) -> nn.Module:
    """The attention the build chose: native where recorded and the kernel runs here, SDPA otherwise (the
    same math; a machine without a compiler loads the artifact all the same)."""
    from torchnitro.autotune.recipes._native_attention import set_native_attention_
    from torchnitro.kernels.cpu_attention import cpu_attention_reason

    if meta.get("native_attention") and cpu_attention_reason() is None:
        set_native_attention_(m, meta["native_attention"])
    return m


def _holds_target(ctx: BuildContext, base: nn.Module, q: nn.Module, meta: dict[str, Any]) -> Callable[[], str | None]:
    """A check for ``q`` as it is when called: None when its calibration cosine stays at the int8 target
    (then recorded in ``meta``), else why not."""
    def check() -> str | None:
        from torchnitro.autotune.recipes.int8_mixed import (_references, calibration_cosine, int8_target,
                                                           varied_calibration_inputs)

        calib, target = varied_calibration_inputs(ctx), int8_target(ctx)
        cos = calibration_cosine(q, calib, _references(base, calib))
        if cos < target:
            return f"calibration cosine {cos:.4f} < {target:.4f}"
        meta["calib_cosine"] = cos
        return None

    return check


# the kept Linears are retried in int8 only where at least this share of the example's positions are real tokens:
# outlier channels chosen on short sentences (20% real) passed their calibration at 0.9952 and missed real long
# text at 0.986 (test_minilm_int8_calibrated_on_short_sentences_holds_on_long_text); chosen on full-length
# text they held on short sentences (0.9957, results/bert_unpad_int8_profile.md)
RETRY_MIN_REAL = 0.75


def _real_share(inputs: tuple[Any, ...]) -> float | None:
    """The share of real positions under the inputs' right-padded attention mask (a feature dict's too);
    None when they carry none."""
    from torchnitro.autotune.inputs import _is_prefix_mask
    from torchnitro.autotune.recipes._layout import tensor_leaves

    mask = next((t for t in tensor_leaves(inputs) if _is_prefix_mask(t)), None)
    return None if mask is None else float((mask != 0).float().mean())


def _retry_kept_(ctx: BuildContext, base: nn.Module, q: nn.Module, meta: dict[str, Any]) -> tuple[nn.Module, str]:
    """``q``, or a variant with the Linears its plan kept out of int8 in int8 where their outlier input
    channels in fp32 keep the calibration target (``_kept_int8``), with the attention the build chose;
    ``meta`` updated to match. Returns the variant and a note ("" when nothing was tried)."""
    from torchnitro.autotune.recipes._graph_attention import enable_graph_attention_
    from torchnitro.autotune.recipes._kept_int8 import retry_kept_in_int8
    from torchnitro.autotune.recipes._native_attention import set_native_attention_
    from torchnitro.autotune.recipes.int8_mixed import int8_target, varied_calibration_inputs

    if not meta["fp32"] or meta["engine"] not in ("onednn", "rowwise"):  # the engines that take outlier channels
        return q, ""
    share = _real_share(ctx.example_inputs)
    if share is not None and share < RETRY_MIN_REAL:
        return q, f"kept Linears not retried in int8: {share:.0%} of the example's tokens are real"
    scales, planned = load_scales(ctx.workdir / "smooth_scales.safetensors"), load_outliers(meta)

    def make(names: list[str], outliers: dict[str, Tensor]) -> nn.Module:
        m = _int8(base, meta["int8"] + names, scales, meta["full_range"], meta["engine"], {**planned, **outliers},
                  meta["bf16_rest"])
        set_native_attention_(m, meta.get("native_attention"))
        if meta.get("graph_attention"):
            enable_graph_attention_(m)
        return m

    r = retry_kept_in_int8(base, meta["fp32"], varied_calibration_inputs(ctx), int8_target(ctx), make)
    if r.model is None:
        return q, r.note
    meta["int8"] = meta["int8"] + r.names
    meta["fp32"] = [n for n in meta["fp32"] if n not in r.names]
    meta["outliers"] = {**meta["outliers"], **{n: [int(i) for i in v] for n, v in r.outliers.items()}}
    meta["calib_cosine"] = r.cosine
    return r.model, r.note


def _quantiser(engine: str, meta: dict[str, Any]) -> str:
    """Which activation quantiser the oneDNN int8 Linears run (``meta["quantiser"]``: "native" or "torch"), as a
    note ("" for the other engines)."""
    if engine != "onednn":
        return ""
    why = cpu_int8_reason()
    meta["quantiser"] = "native" if why is None else "torch"
    return "activation quantiser: native (kernels.cpu_int8)" if why is None else f"activation quantiser: torch ({why})"


def _bf16_rest_reason() -> str | None:
    """None when the Linears an int8 plan keeps out of int8 can run in bf16 here (native bf16 oneDNN)."""
    from torchnitro.autotune.recipes.onednn_bf16 import onednn_bf16_reason
    from torchnitro.hardware import hardware_info

    return onednn_bf16_reason() or (None if hardware_info().cpu_bf16 else "the CPU has no native bf16")


def bert_inapplicable_reason(model: nn.Module) -> str | None:
    """None when ``model`` is, or holds, a BERT-family HF encoder these recipes mirror."""
    from torchnitro.hf import SentenceEncoder

    if isinstance(model, SentenceEncoder):
        return encoders_reason(model.encoder)
    return encoders_reason(model)


def unpad_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` (a private copy: it is changed) with its encoders padding-free. ``dtype``: compute
    the encoder in it (the SentenceEncoder's pooling and an in-place encoder's outputs stay fp32)."""
    from torchnitro.hf import SentenceEncoder

    if isinstance(model, SentenceEncoder):
        m = UnpaddedBert(model)
        return (m.to(dtype) if dtype is not None else m).eval()
    return unpad_encoders_(model, dtype).eval()


def _real_fraction(inputs: tuple[Any, ...]) -> str:
    mask = inputs[1] if len(inputs) > 1 else None
    if isinstance(mask, Tensor) and mask.dim() == 2 and not mask.is_floating_point():
        return f"{float((mask != 0).float().mean()):.0%} of the example's tokens are real"
    return ""


@register_recipe
class UnpaddedBertRecipe(Recipe):
    name = "bert-unpad"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.EXACT
    description = "BERT-family encoders on real tokens only (padding removed), fused QKV GEMM"
    order = 15
    version = "3"  # 2: encoders anywhere in the model tree, not only torchnitro.hf.SentenceEncoder; 3: native
    # varlen attention where measured faster

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        m = unpad_model(ctx.model)
        meta: dict[str, Any] = {}
        attention = _choose_attention(ctx, m, ("fp32",), meta)
        return Built(fn=m, meta=meta, notes="; ".join(n for n in (_real_fraction(ctx.example_inputs), attention) if n))

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return _native_on_load(unpad_model(copy.deepcopy(self.require_model(model)).eval()), meta)


@register_recipe
class UnpaddedBertInt8(Recipe):
    name = "bert-unpad-int8"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.INT8
    description = ("padding-free BERT + SmoothQuant dynamic int8 Linears, gate-sensitive layers kept in bf16 (fp32 where "
                   "the CPU has no native bf16)")
    order = 16
    version = "8"  # 2: fused oneDNN int8 Linear; 3: encoders anywhere in the model; 4: per-token int8 (rowwise);
    # 5: SmoothQuant folded into in-place encoders too; feature-dict models calibrated on varied lengths against
    # copied references; the Linears the plan keeps out of int8 in bf16 where the CPU has it; 6: native varlen
    # attention where measured faster and the calibration cosine holds; 7: kept Linears retried in int8 with
    # their outlier input channels in fp32 (_kept_int8); 8: the native activation quantiser (kernels.cpu_int8) with
    # SmoothQuant of qkv/ffn_in applied there (not folded into the LayerNorms), residual sums in place
    # fused bf16 attention (oneDNN Graph) for batches without padding: off. 1.34x less CPU time than SDPA alone
    # at all-MiniLM-L6-v2's shapes, but the whole int8 variant took 7% more CPU time with it (one loaded run:
    # results/encoder_full_length.md); an artifact that recorded it on still loads it on
    graph_attention = False

    def unavailable_reason(self, hw: Any) -> str | None:
        return int8_unavailable_reason()

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if any(isinstance(x, Tensor) and x.is_cuda for x in example_inputs):
            return "dynamic int8 kernels run on the CPU only"
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        base = unpad_model(ctx.model)
        kept = ("bf16", "fp32") if _bf16_rest_reason() is None else ("fp32",)  # for the Linears kept out of int8
        q, meta, engine = build_mixed_int8(
            ctx, base, lambda plan, e, k="fp32": _int8(base, plan["int8"], plan["scales"], plan["full_range"], e,
                                                       plan["outliers"], k == "bf16"), kept)
        rest = meta["bf16_rest"] = meta["kept"] == "bf16"
        meta["graph_attention"] = False
        if self.graph_attention:
            attention = _graph_attention_(ctx, base, q, meta)
        else:
            # bf16 products first where native (rounding q, k and the probabilities can cost the plan its
            # calibration target), then fp32
            attention = _choose_attention(ctx, q, native_computes(), meta, _holds_target(ctx, base, q, meta))
        q, retried = _retry_kept_(ctx, base, q, meta)
        quantiser = _quantiser(engine, meta)
        n_out = sum(len(v) for v in meta["outliers"].values())
        return Built(fn=q, files=["smooth_scales.safetensors"], meta=meta,
                     notes=f"{len(meta['int8'])}/{len(linear_names(base))} Linear int8 ({engine}), "
                           f"{'bf16' if rest else 'fp32'} kept: "
                           f"{', '.join(meta['fp32']) or 'none'}; "
                           + (f"{n_out} outlier input channels in fp32 in {len(meta['outliers'])} Linears; "
                              if n_out else "")
                           + (f"{retried}; " if retried else "")
                           + (f"{quantiser}; " if quantiser else "")
                           + f"{attention}; calibration cosine {meta['calib_cosine']:.4f}")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        from torchnitro.autotune.recipes._graph_attention import enable_graph_attention_, graph_attention_reason

        base = unpad_model(copy.deepcopy(self.require_model(model)).eval())
        if meta.get("quantiser") == "native" and cpu_int8_reason() is not None:
            warnings.warn(f"bert-unpad-int8: built with the native activation quantiser, which is not available "
                          f"here ({cpu_int8_reason()}); torch ops quantise instead (the same values, slower)",
                          stacklevel=2)
        q = _int8(base, meta["int8"], load_scales(directory / "smooth_scales.safetensors"), load_full_range(meta),
                  load_engine(meta, self.name), load_outliers(meta),
                  bool(meta.get("bf16_rest")) and _bf16_rest_reason() is None)
        if meta.get("graph_attention") and graph_attention_reason() is None:
            enable_graph_attention_(q)
        return _native_on_load(q, meta)


@register_recipe
class UnpaddedBertBf16(Recipe):
    name = "bert-unpad-bf16"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.REDUCED
    description = "padding-free BERT with bf16 weights and activations (AVX512-BF16/AMX GEMMs), fp32 outputs"
    order = 17
    version = "4"  # 2: encoders anywhere in the model tree; 3: Linears prepacked on oneDNN, fused epilogues;
    # 4: native varlen attention where measured faster

    def unavailable_reason(self, hw: Any) -> str | None:
        if not (hw.cpu_bf16 or hw.has_gpu):
            return "the CPU has no native bf16 (avx512_bf16/amx_bf16); bf16 would be emulated and slower"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        m, why = _bf16(ctx.model)
        meta: dict[str, Any] = {"prepacked": why is None}
        attention = _choose_attention(ctx, m, ("bf16",), meta)
        return Built(fn=m, meta=meta,
                     notes="bf16 compute, fp32 pooling and outputs; " + (
                         "Linears prepacked on oneDNN, GELU and residual adds in their epilogue" if why is None
                         else f"plain bf16 Linears ({why})") + f"; {attention}")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return _native_on_load(_bf16(copy.deepcopy(self.require_model(model)).eval())[0], meta)


def _bf16(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``model`` padding-free in bf16, its packed layers' Linears on oneDNN's prepacked bf16 kernels
    where they run (the same math: bf16 GEMMs with fp32 accumulation); returns why not otherwise."""
    from torchnitro.autotune.recipes.onednn_bf16 import onednn_bf16_reason, prepack_bf16_

    m = unpad_model(model, torch.bfloat16)
    why = onednn_bf16_reason()
    if why is None and not prepack_bf16_(m):
        why = "no bf16 CPU Linears to prepack"
    return m, why
