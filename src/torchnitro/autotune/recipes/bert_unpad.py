"""Padding-aware BERT sentence encoders: compute only on real tokens.

Sentence-embedding workloads pad every sentence of a batch to one length; eager BERT spends its
GEMMs on the padding too. ``UnpaddedBert`` re-implements the BERT encoder (same weights, same math)
on the packed real tokens ``(N, D)``, N = attention_mask.sum(), as FlashAttention's varlen/"unpad"
path and NVIDIA's FasterTransformer "remove padding" do:

- embeddings, every Linear, GELU and LayerNorm run on ``(N, D)`` rows only;
- Q, K and V are one fused GEMM ``(N, D) @ (D, 3D)``;
- attention runs per length bucket: sentences sorted by length are split into a few groups, each
  padded only to its own longest sentence (``length_buckets``), so attention costs ``sum(G * L**2)``
  instead of ``B * T**2``; a batch without padding skips the scatter/gather and the mask;
- the FFN runs in row blocks so its ``(rows, 4D)`` GELU temporary stays in cache;
- mean pooling is an ``index_add`` over rows, then L2 normalisation (sentence-transformers).

Real tokens see exactly the same computation as in eager, so the fp32 variant is an EXACT recipe;
how much it saves is the padding fraction of the inputs (measured, never assumed). The int8 variant
adds SmoothQuant + accuracy-aware mixed int8 (``int8_mixed``) to its Linears.

Applies to ``torchnitro.hf.SentenceEncoder`` around an HF ``BertModel`` with absolute positions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes.int8_mixed import (build_mixed_int8, int8_unavailable_reason, linear_names,
                                                   load_engine, load_full_range, load_scales, quantize_linears)
from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear

__all__ = ["UnpaddedBert", "length_buckets", "fold_smoothing", "bert_inapplicable_reason", "UnpaddedBertRecipe",
           "UnpaddedBertInt8", "UnpaddedBertBf16"]


@dataclass
class _Bucket:
    """Sequences of similar length attended together in a ``(G, L)`` layout, L = their longest length.

    ``rows``: their tokens' rows in the packed ``(N, D)`` activations in (batch, position) order
    (``UnpaddedBert`` then reorders the rows so each bucket is one slice); ``slots``: the same tokens'
    flat positions in ``(G*L)`` (each sequence packed to the left: positions were already embedded,
    and attention does not depend on where a key sits); ``mask``: ``(G, 1, 1, L)`` key mask, None
    when every sequence has length L. ``rows is None``: the whole batch, no padding anywhere."""

    g: int
    l: int
    rows: Tensor | None = None
    slots: Tensor | None = None
    mask: Tensor | None = None
    _buf: Tensor | None = None

    def buffer(self, like: Tensor) -> Tensor:
        if self._buf is None or self._buf.dtype != like.dtype:
            self._buf = like.new_zeros(self.g * self.l, like.shape[1])  # shared by every layer of one call
        return self._buf


def length_buckets(attention_mask: Tensor, n_buckets: int) -> list[_Bucket]:
    """Split the batch into at most ``n_buckets`` groups of sequences sorted by length: attention and
    its padding cost ``sum(G * L**2)`` instead of ``B * T**2``."""
    b, t = attention_mask.shape
    real = attention_mask != 0  # (B, T)
    lens = real.sum(1)  # (B,)
    if bool((lens == t).all()):
        return [_Bucket(b, t)]
    off = torch.cumsum(lens, 0) - lens  # first row of each sequence in (N, D): rows are in (batch, position) order
    order = torch.argsort(lens, stable=True)
    order = order[lens[order] > 0]  # a sequence without real tokens has no rows (its embedding is zero, as in eager)
    size = max(1, -(-b // max(1, n_buckets)))
    out = []
    for seqs in order.split(size):  # (G,) sequence ids, shortest first
        ls = lens[seqs]  # (G,)
        g, l = seqs.numel(), int(ls.max())
        seq_of = torch.repeat_interleave(torch.arange(g, device=ls.device), ls)  # (n,) bucket-local sequence
        within = torch.arange(seq_of.numel(), device=ls.device) - torch.repeat_interleave(torch.cumsum(ls, 0) - ls, ls)
        mask = None
        if not bool((ls == l).all()):
            mask = (torch.arange(l, device=ls.device)[None] < ls[:, None]).view(g, 1, 1, l)  # (G, 1, 1, L)
        out.append(_Bucket(g, l, off[seqs][seq_of] + within, seq_of * l + within, mask))
    return out


class _Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, n_heads: int):
        super().__init__()
        att = hf_layer.attention
        sa = att.self
        d = sa.query.in_features
        self.n_heads, self.head_dim = n_heads, d // n_heads
        w = sa.query.weight
        self.qkv = nn.Linear(d, 3 * d, device=w.device, dtype=w.dtype)  # beside the model's own weights
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([sa.query.weight, sa.key.weight, sa.value.weight], 0))  # (3D, D)
            self.qkv.bias.copy_(torch.cat([sa.query.bias, sa.key.bias, sa.value.bias], 0))
        self.out = att.output.dense
        self.ln1 = att.output.LayerNorm
        self.ffn_in = hf_layer.intermediate.dense
        self.ffn_out = hf_layer.output.dense
        self.ln2 = hf_layer.output.LayerNorm
        # SmoothQuant scales folded into the LayerNorm that feeds qkv / ffn_in (see fold_smoothing):
        # that LayerNorm then emits x / s, and the residual adds x back as addcmul(y, x / s, s).
        self.res_in: Tensor | None = None
        self.res_mid: Tensor | None = None

    @staticmethod
    def _plus_residual(lin: nn.Module, inp: Tensor, x: Tensor, scale: Tensor | None) -> Tensor:
        """``lin(inp) + x * scale`` (``+ x`` without a SmoothQuant scale); in the GEMM epilogue on oneDNN."""
        if isinstance(lin, OneDnnInt8Linear):
            return lin(inp, add=x if scale is None else x * scale)
        y = lin(inp)
        return x + y if scale is None else torch.addcmul(y, x, scale)

    ffn_rows = 1024  # FFN row block: its (rows, 4D) GELU temporary stays in cache instead of a (N, 4D) round trip

    def _ffn_residual(self, x: Tensor) -> Tensor:
        """``x + ffn(x)`` (SmoothQuant residual scale applied), by row blocks."""
        if x.shape[0] <= self.ffn_rows:
            return self._ffn_block(x)
        # rows are independent in the FFN; each block's (rows, 4D) temporary stays in cache
        return torch.cat([self._ffn_block(xs) for xs in x.split(self.ffn_rows)])  # (N, D)

    def _ffn_block(self, x: Tensor) -> Tensor:
        if isinstance(self.ffn_in, OneDnnInt8Linear):
            h = self.ffn_in(x, gelu=True)  # GELU in the GEMM epilogue
        else:
            h = F.gelu(self.ffn_in(x))  # a temporary: int8 ffn_out smooths it in place
        return self._plus_residual(self.ffn_out, h, x, self.res_mid)

    def _attend(self, qkv: Tensor, buckets: list[_Bucket]) -> Tensor:
        n, d = qkv.shape[0], qkv.shape[1] // 3  # qkv: (N, 3D)
        if buckets[0].rows is None:  # no padding: (N, 3D) is (B*T, 3D) and nothing is masked
            bk = buckets[0]
            q, k, v = qkv.view(bk.g, bk.l, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, d)
        outs, start = [], 0
        for bk in buckets:  # the rows are in bucket order (UnpaddedBert.forward), so each bucket is one slice
            seg = qkv[start:start + bk.rows.numel()]  # (n_b, 3D)
            start += bk.rows.numel()
            if bk.mask is None:  # every sentence in the bucket has length L: the rows already are (G, L)
                src = seg
            else:
                src = bk.buffer(qkv)  # (G*L, 3D); slots outside the real tokens stay zero (finite keys, masked out)
                src.index_copy_(0, bk.slots, seg)
            q, k, v = src.view(bk.g, bk.l, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (G, H, L, Dh)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bk.mask)  # (G, H, L, Dh)
            o = o.transpose(1, 2).reshape(bk.g * bk.l, d)
            outs.append(o if bk.mask is None else o.index_select(0, bk.slots))
        return torch.cat(outs)  # (N, D)

    def forward(self, x: Tensor, buckets: list[_Bucket]) -> Tensor:
        ctx = self._attend(self.qkv(x), buckets)  # x: (N, D) real tokens
        x = self.ln1(self._plus_residual(self.out, ctx, x, self.res_in))
        return self.ln2(self._ffn_residual(x))


class UnpaddedBert(nn.Module):
    """``(input_ids, attention_mask) -> (B, D)`` normalised mean-pooled embeddings, on real tokens only."""

    def __init__(self, sentence_encoder: nn.Module):
        super().__init__()
        bert = sentence_encoder.encoder
        cfg = bert.config
        emb = bert.embeddings
        self.word, self.pos, self.tok_type, self.ln_emb = (emb.word_embeddings, emb.position_embeddings,
                                                           emb.token_type_embeddings, emb.LayerNorm)
        self.layers = nn.ModuleList(_Layer(layer, cfg.num_attention_heads)
                                    for layer in bert.encoder.layer)
        self.normalize = bool(getattr(sentence_encoder, "normalize", True))

    attention_buckets = 4  # groups of similar-length sentences attended separately (1: the whole batch padded to T)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        b, t = input_ids.shape
        keep = attention_mask.reshape(-1) != 0  # (B*T,)
        idx = keep.nonzero().squeeze(1)  # (N,) flat positions of real tokens, in (batch, position) order
        buckets = length_buckets(attention_mask, self.attention_buckets)
        dense = buckets[0].rows is None  # no padding anywhere
        if not dense:  # rows in bucket order: each bucket's tokens are one contiguous slice in every layer
            idx = idx[torch.cat([bk.rows for bk in buckets])]
        pos = idx % t  # absolute position of each real token
        x = self.word(input_ids.reshape(-1)[idx]) + self.pos(pos) + self.tok_type.weight[0]  # (N, D)
        x = self.ln_emb(x)
        for layer in self.layers:
            x = layer(x, buckets)
        x = x.float()  # pool in fp32 whatever the compute dtype
        if dense:
            full = x  # (B*T, D) already
        else:
            full = x.new_zeros(b * t, x.shape[1])
            full[idx] = x  # back to (B*T, D) with zero padding: a dense sum beats index_add_ on CPU
        summed = full.view(b, t, -1).sum(1)  # (B, D)
        count = attention_mask.sum(1, keepdim=True).to(x.dtype).clamp(min=1e-9)  # (B, 1)
        emb = summed / count
        return F.normalize(emb, p=2.0, dim=1) if self.normalize else emb


def _scale_ln(ln: nn.LayerNorm, s: Tensor) -> None:
    with torch.no_grad():
        ln.weight.div_(s)
        ln.bias.div_(s)


def fold_smoothing(base: UnpaddedBert, scales: dict[str, Tensor]) -> tuple[UnpaddedBert, dict[str, Tensor]]:
    """A copy of ``base`` with SmoothQuant scales folded into weights where that is exact, so the
    int8 Linears need no ``x / s`` multiply: the attention output's scale goes into the V rows of
    qkv (attention is linear in V), qkv's and ffn_in's into the LayerNorm that feeds them (its
    residual becomes ``addcmul``). Returns the copy and the scales still to apply at run time."""
    m = copy.deepcopy(base)
    left = dict(scales)
    prev_ln = m.ln_emb
    for i, layer in enumerate(m.layers):
        d = layer.out.in_features
        s = left.pop(f"layers.{i}.out", None)
        if s is not None:
            with torch.no_grad():
                layer.qkv.weight[2 * d:] /= s[:, None]  # V rows: ctx comes out divided by s
                layer.qkv.bias[2 * d:] /= s
                layer.out.weight *= s  # columns: out(ctx / s) with W * s == out(ctx)
        s = left.pop(f"layers.{i}.qkv", None)
        if s is not None:
            _scale_ln(prev_ln, s)
            with torch.no_grad():
                layer.qkv.weight *= s
            layer.res_in = s  # the previous LayerNorm now emits x / s; only this layer reads it
        s = left.pop(f"layers.{i}.ffn_in", None)
        if s is not None:
            _scale_ln(layer.ln1, s)
            with torch.no_grad():
                layer.ffn_in.weight *= s
            layer.res_mid = s
        prev_ln = layer.ln2
    return m, left


def _int8(base: UnpaddedBert, names: list[str], scales: dict[str, Tensor], full_range: bool,
          engine: str = "fbgemm") -> nn.Module:
    """``base`` with the Linears ``names`` in int8. ``onednn``: fused oneDNN kernels that smooth in the
    activation quantisation and take GELU / the residual add into the GEMM epilogue; ``fbgemm``:
    PyTorch's dynamic int8 Linear with the smoothing folded into the weights where exact."""
    from torchnitro.autotune.recipes.int8_mixed import SmoothedInt8Linear

    folded, left = fold_smoothing(base, scales)
    q = quantize_linears(folded, names, left, full_range, engine)
    for layer in q.layers:
        if isinstance(layer.ffn_out, (SmoothedInt8Linear, OneDnnInt8Linear)):
            layer.ffn_out.inplace = True  # its input is the GELU temporary
    return q


def bert_inapplicable_reason(model: nn.Module) -> str | None:
    """None when ``model`` is a SentenceEncoder around a plain HF BERT this module can mirror."""
    from torchnitro.hf import SentenceEncoder

    if not isinstance(model, SentenceEncoder):
        return "not a torchnitro.hf.SentenceEncoder (mean-pooled HF encoder)"
    cfg = getattr(model.encoder, "config", None)
    if getattr(cfg, "model_type", None) != "bert":
        return f"encoder model_type is {getattr(cfg, 'model_type', None)!r}; this recipe mirrors 'bert' only"
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        return "relative position embeddings are not mirrored"
    if getattr(cfg, "hidden_act", None) != "gelu":
        return f"hidden_act {cfg.hidden_act!r}; this recipe mirrors exact (erf) 'gelu' only"
    return None


@register_recipe
class UnpaddedBertRecipe(Recipe):
    name = "bert-unpad"
    numeric_class = NumericClass.EXACT
    description = "BERT sentence encoder on real tokens only (padding removed), fused QKV GEMM"
    order = 15

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        m = UnpaddedBert(ctx.model).eval()
        mask = ctx.example_inputs[1]
        frac = float(mask.float().mean()) if isinstance(mask, Tensor) else 1.0
        return Built(fn=m, notes=f"{frac:.0%} of the example's tokens are real")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = self.require_model(model)
        return UnpaddedBert(model.eval()).eval()


@register_recipe
class UnpaddedBertInt8(Recipe):
    name = "bert-unpad-int8"
    numeric_class = NumericClass.INT8
    description = "padding-free BERT + SmoothQuant dynamic int8 Linears, gate-sensitive layers kept fp32"
    order = 16
    version = "2"  # 2: built on the fused oneDNN int8 Linear where it runs

    def unavailable_reason(self, hw: Any) -> str | None:
        return int8_unavailable_reason()

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if any(isinstance(x, Tensor) and x.is_cuda for x in example_inputs):
            return "dynamic int8 kernels run on the CPU only"
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        base = UnpaddedBert(ctx.model).eval()
        q, meta, engine = build_mixed_int8(
            ctx, base, lambda plan, e: _int8(base, plan["int8"], plan["scales"], plan["full_range"], e))
        return Built(fn=q, files=["smooth_scales.safetensors"], meta=meta,
                     notes=f"{len(meta['int8'])}/{len(linear_names(base))} Linear int8 ({engine}), fp32 kept: "
                           f"{', '.join(meta['fp32']) or 'none'}; calibration cosine {meta['calib_cosine']:.4f}")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = self.require_model(model)
        base = UnpaddedBert(model.eval()).eval()
        return _int8(base, meta["int8"], load_scales(directory / "smooth_scales.safetensors"), load_full_range(meta),
                     load_engine(meta, self.name))


def _bf16(model: nn.Module) -> nn.Module:
    return UnpaddedBert(copy.deepcopy(model).eval()).to(torch.bfloat16).eval()


@register_recipe
class UnpaddedBertBf16(Recipe):
    name = "bert-unpad-bf16"
    numeric_class = NumericClass.REDUCED
    description = "padding-free BERT with bf16 weights and activations (AVX512-BF16/AMX GEMMs), fp32 pooling"
    order = 17

    def unavailable_reason(self, hw: Any) -> str | None:
        if not (hw.cpu_bf16 or hw.has_gpu):
            return "the CPU has no native bf16 (avx512_bf16/amx_bf16); bf16 would be emulated and slower"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        return bert_inapplicable_reason(model)

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=_bf16(ctx.model), notes="bf16 compute, fp32 mean pooling")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = self.require_model(model)
        return _bf16(model)
