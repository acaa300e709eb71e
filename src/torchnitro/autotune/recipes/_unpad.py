"""The packed-token core of the padding-free encoder recipes (``bert_unpad``, ``hf_encoders``).

A post-LayerNorm encoder layer (BERT, RoBERTa, DistilBERT, MPNet, ELECTRA: same math, other module
names; MPNet adds a relative position bias to the attention scores, ``position_bias_``) run on
the packed real tokens ``(N, D)``, N = attention_mask.sum(), as FlashAttention's varlen/"unpad" path
and NVIDIA FasterTransformer's "remove padding" do:

- every Linear, GELU and LayerNorm runs on ``(N, D)`` rows only;
- Q, K and V are one fused GEMM ``(N, D) @ (D, 3D)``;
- attention runs per length bucket: sentences sorted by length are split into a few groups, each
  padded only to its own longest sentence (``length_buckets``), so attention costs ``sum(G * L**2)``
  instead of ``B * T**2``; a batch without padding skips the scatter/gather and the mask. Where a
  build measured it faster (``_native_attention.choose_attention_``), the native varlen kernel
  (``torchnitro.kernels.cpu_attention``) attends each sentence on its own packed rows instead: no
  padding, mask, copy or gather at all;
- the FFN runs in row blocks so its ``(rows, 4D)`` GELU temporary stays in cache.

Real tokens see the same computation as in eager (up to float reassociation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["cu_seqlens", "length_buckets", "LayerParts", "PackedLayer", "Packing", "pack_tokens", "position_bias_",
           "run_layers"]


@dataclass
class _Bucket:
    """Sequences of similar length attended together in a ``(G, L)`` layout, L = their longest length.

    ``rows``: their tokens' rows in the packed ``(N, D)`` activations in (batch, position) order
    (``UnpaddedBert`` then reorders the rows so each bucket is one slice); ``slots``: the same tokens'
    flat positions in ``(G*L)`` (each sequence packed to the left: positions were already embedded,
    and attention does not depend on where a key sits); ``mask``: ``(G, 1, 1, L)`` key mask, None
    when every sequence has length L. ``rows is None``: the whole batch, no padding anywhere.
    ``bias``: an additive attention bias ``(G or 1, H, L, L)`` (MPNet's relative positions) with the
    masked keys at -inf, used instead of ``mask`` when set (``position_bias_``)."""

    g: int
    l: int
    rows: Tensor | None = None
    slots: Tensor | None = None
    mask: Tensor | None = None
    bias: Tensor | None = None
    lens: Tensor | None = None  # (G,) sequence lengths; None: all L
    _buf: Tensor | None = None
    _cu: Tensor | None = None  # cu_seqlens of the whole packing, cached on the first bucket (see cu_seqlens)

    def attn_mask(self, dtype: torch.dtype) -> Tensor | None:
        """What SDPA gets as ``attn_mask``: the bias in the attention's dtype (cast once per call), else the mask."""
        if self.bias is None:
            return self.mask
        if self.bias.dtype != dtype:
            self.bias = self.bias.to(dtype)  # shared by every layer of one call
        return self.bias

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
        out.append(_Bucket(g, l, off[seqs][seq_of] + within, seq_of * l + within, mask, lens=ls))
    return out


def cu_seqlens(buckets: list[_Bucket]) -> Tensor:
    """``(B' + 1,)`` int64 row offsets of the sequences in the packed rows (bucket order), for varlen
    attention; computed once per call, cached on the first bucket."""
    first = buckets[0]
    if first._cu is None:
        lens = [bk.lens if bk.lens is not None else torch.full((bk.g,), bk.l) for bk in buckets]
        first._cu = F.pad(torch.cat(lens).cpu().to(torch.int64).cumsum(0), (1, 0))
    return first._cu


@dataclass
class LayerParts:
    """The modules of one post-LayerNorm encoder layer, whatever the architecture calls them:
    ``ln1(x + out(attn(q(x), k(x), v(x))))``, then ``ln2(h + ffn_out(gelu(ffn_in(h))))``."""

    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    out: nn.Linear
    ln1: nn.LayerNorm
    ffn_in: nn.Linear
    ffn_out: nn.Linear
    ln2: nn.LayerNorm

    @classmethod
    def bert(cls, layer: nn.Module) -> "LayerParts":
        """BERT / RoBERTa / XLM-R / ELECTRA layers (``attention.self.query`` ...)."""
        att = layer.attention
        return cls(att.self.query, att.self.key, att.self.value, att.output.dense, att.output.LayerNorm,
                   layer.intermediate.dense, layer.output.dense, layer.output.LayerNorm)

    @classmethod
    def distilbert(cls, layer: nn.Module) -> "LayerParts":
        """DistilBERT ``TransformerBlock`` (``attention.q_lin`` ...)."""
        att = layer.attention
        return cls(att.q_lin, att.k_lin, att.v_lin, att.out_lin, layer.sa_layer_norm, layer.ffn.lin1, layer.ffn.lin2,
                   layer.output_layer_norm)

    @classmethod
    def mpnet(cls, layer: nn.Module) -> "LayerParts":
        """MPNet ``MPNetLayer`` (``attention.attn.q`` ...; its relative position bias comes from ``position_bias_``)."""
        att = layer.attention
        return cls(att.attn.q, att.attn.k, att.attn.v, att.attn.o, att.LayerNorm, layer.intermediate.dense,
                   layer.output.dense, layer.output.LayerNorm)


class PackedLayer(nn.Module):
    """One encoder layer on the packed real tokens ``(N, D)``; Q, K and V fused into one GEMM."""

    def __init__(self, parts: LayerParts, n_heads: int):
        super().__init__()
        d = parts.q.in_features
        self.n_heads, self.head_dim = n_heads, d // n_heads
        w = parts.q.weight
        self.qkv = nn.Linear(d, 3 * d, device=w.device, dtype=w.dtype)  # beside the model's own weights
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([parts.q.weight, parts.k.weight, parts.v.weight], 0))  # (3D, D)
            self.qkv.bias.copy_(torch.cat([parts.q.bias, parts.k.bias, parts.v.bias], 0))
        self.out, self.ln1, self.ffn_in, self.ffn_out, self.ln2 = (parts.out, parts.ln1, parts.ffn_in, parts.ffn_out,
                                                                   parts.ln2)
        # SmoothQuant scales folded into the LayerNorm that feeds qkv / ffn_in (see fold_smoothing):
        # that LayerNorm then emits x / s, and the residual adds x back as addcmul(y, x / s, s).
        self.res_in: Tensor | None = None
        self.res_mid: Tensor | None = None
        # _graph_attention.GraphAttention: fused bf16 attention for a batch without padding (None: SDPA)
        self.graph_attention = None
        # kernels.cpu_attention.NativeAttention: varlen attention on the packed rows, any padding; not for an
        # additive bias (MPNet), which keeps SDPA. Set where a build measured it faster (_native_attention; None: SDPA)
        self.native_attention = None

    @staticmethod
    def _plus_residual(lin: nn.Module, inp: Tensor, x: Tensor, scale: Tensor | None, owned: bool) -> Tensor:
        """``lin(inp) + x * scale`` (``+ x`` without a SmoothQuant scale); in the int8 Linear's epilogue.
        ``owned``: ``x`` is this layer's own temporary, which a Linear that takes ``accumulate`` may write
        the sum into (no output allocation: with glibc's default thresholds each fresh one faults in again)."""
        if getattr(lin, "fused_epilogue", False):  # int8 Linears that add in their epilogue
            r = x if scale is None else x * scale  # (N, out); x * scale is a temporary of its own
            if getattr(lin, "takes_accumulate", False) and (owned or scale is not None):
                return lin(inp, add=r, accumulate=True)
            return lin(inp, add=r)
        y = lin(inp)
        return x + y if scale is None else torch.addcmul(y, x, scale)

    # FFN row block: bounds the (rows, 4D) GELU temporary. An int8 Linear's activation range is taken per
    # call, so a block is also its quantisation granularity: full-length all-MiniLM-L6-v2 (4096 rows) run
    # unsplit was 3% faster but lost calibration accuracy, and its plan then kept a fourth FFN
    # down-projection out of int8, in fp32 (results/encoder_full_length.md)
    ffn_rows = 1024

    def _ffn_residual(self, x: Tensor) -> Tensor:
        """``x + ffn(x)`` (SmoothQuant residual scale applied), by row blocks. ``x`` (the first LayerNorm's
        output, this layer's own) may be overwritten with the result."""
        if x.shape[0] <= self.ffn_rows:
            return self._ffn_block(x)
        # rows are independent in the FFN; each block's (rows, 4D) temporary stays in cache
        blocks = x.split(self.ffn_rows)
        outs = [self._ffn_block(xs) for xs in blocks]
        if all(o.data_ptr() == xs.data_ptr() and o.dtype == x.dtype for o, xs in zip(outs, blocks)):
            return x  # every block's sum was written into its rows of x: nothing to concatenate
        return torch.cat(outs)  # (N, D)

    def _ffn_block(self, x: Tensor) -> Tensor:
        if getattr(self.ffn_in, "fused_epilogue", False):
            h = self.ffn_in(x, gelu=True)  # GELU in the int8 Linear's epilogue
        else:
            h = F.gelu(self.ffn_in(x))  # a temporary: int8 ffn_out smooths it in place
        return self._plus_residual(self.ffn_out, h, x, self.res_mid, owned=True)

    def _attend(self, qkv: Tensor, buckets: list[_Bucket]) -> Tensor:
        n, d = qkv.shape[0], qkv.shape[1] // 3  # qkv: (N, 3D)
        if buckets[0].rows is None:  # no padding: (N, 3D) is (B*T, 3D) and nothing is masked
            bk = buckets[0]
            q, k, v = qkv.view(bk.g, bk.l, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bk.attn_mask(q.dtype))  # (B, H, T, Dh)
            return o.transpose(1, 2).reshape(n, d)
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
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bk.attn_mask(q.dtype))  # (G, H, L, Dh)
            o = o.transpose(1, 2).reshape(bk.g * bk.l, d)
            outs.append(o if bk.mask is None else o.index_select(0, bk.slots))
        return torch.cat(outs)  # (N, D)

    def attention(self, x: Tensor, buckets: list[_Bucket]) -> Tensor:
        """``(N, D)`` real-token rows -> the ``(N, D)`` attention context in ``x``'s dtype: qkv GEMM, then the
        native varlen kernel, the fused graph (no padding) or SDPA by buckets."""
        plain = buckets[0].bias is None  # no position bias
        na = getattr(self, "native_attention", None) if plain and x.device.type == "cpu" else None
        ga = getattr(self, "graph_attention", None) if plain and na is None and buckets[0].rows is None else None
        reads_bf16 = ga is not None or (na is not None and na.compute == "bf16")
        if reads_bf16 and getattr(self.qkv, "takes_out_dtype", False):
            qkv = self.qkv(x, out_dtype=torch.bfloat16)  # (N, 3D); the attention rounds to bf16 anyway
        else:
            qkv = self.qkv(x)
        if na is not None:
            return na(qkv, cu_seqlens(buckets), self.n_heads, x.dtype)
        o = ga(qkv, buckets[0].g, buckets[0].l) if ga is not None else None  # None: it cannot run, SDPA does
        return o.to(x.dtype) if o is not None else self._attend(qkv.to(x.dtype), buckets)

    def forward(self, x: Tensor, buckets: list[_Bucket], owned: bool = False) -> Tensor:
        """``(N, D)`` real-token rows -> the layer's ``(N, D)`` output. ``owned``: ``x`` is the caller's
        temporary, which the layer may overwrite (``run_layers``)."""
        ctx = self.attention(x, buckets)  # x: (N, D) real tokens
        x = self.ln1(self._plus_residual(self.out, ctx, x, self.res_in, owned))
        return self.ln2(self._ffn_residual(x))


@dataclass
class Packing:
    """Where a padded ``(B, T)`` batch's real tokens sit in the packed ``(N, D)`` rows."""

    idx: Tensor  # (N,) flat positions in (B*T) of the rows, in bucket order
    buckets: list[_Bucket]
    dense: bool  # no padding anywhere: the rows are (B*T) in order

    def scatter(self, x: Tensor, b: int, t: int) -> Tensor:
        """``(N, D)`` rows -> ``(B, T, D)`` with zeros at the padded positions."""
        if self.dense:
            return x.view(b, t, -1)
        full = x.new_zeros(b * t, x.shape[1])
        full[self.idx] = x  # a dense scatter beats index_add_ on CPU
        return full.view(b, t, -1)


def pack_tokens(attention_mask: Tensor, n_buckets: int) -> Packing:
    """The packing of a ``(B, T)`` mask (nonzero = real token) into length buckets."""
    keep = attention_mask.reshape(-1) != 0  # (B*T,)
    idx = keep.nonzero().squeeze(1)  # (N,) flat positions of real tokens, in (batch, position) order
    buckets = length_buckets(attention_mask, n_buckets)
    dense = buckets[0].rows is None  # no padding anywhere
    if not dense:  # rows in bucket order: each bucket's tokens are one contiguous slice in every layer
        idx = idx[torch.cat([bk.rows for bk in buckets])]
    return Packing(idx, buckets, dense)


def position_bias_(packing: Packing, t: int, bias: Callable[[Tensor], Tensor]) -> None:
    """Give every bucket the additive attention bias of relative positions (MPNet), as the padded
    ``(B, T)`` layout has it: ``bias(key_pos - query_pos)`` over positions in the row, ``(..., ) -> (..., H)``.

    Real tokens that are contiguous in their row (right or left padding) have the same distances in
    the bucket's left-packed slots, so one ``(1, H, L, L)`` bias serves the bucket; a mask with holes
    gets each sequence's own ``(G, H, L, L)``. Masked keys are set to -inf (they only hold zeros)."""
    dev = packing.idx.device
    start = 0
    for bk in packing.buckets:
        ar = torch.arange(bk.l, device=dev)
        if bk.rows is None:  # no padding: positions are 0..T-1 in every row
            bk.bias = bias(ar[None] - ar[:, None]).permute(2, 0, 1).unsqueeze(0)  # (1, H, T, T)
            continue
        n = bk.rows.numel()
        pos = packing.idx[start:start + n] % t  # (n,) each token's position in its padded row, in slot order
        start += n
        seq, within = bk.slots // bk.l, bk.slots % bk.l  # (n,) bucket-local sequence and slot
        first = pos[within == 0]  # (G,) each sequence's first real position
        if bool((pos - first[seq] == within).all()):
            b = bias(ar[None] - ar[:, None]).permute(2, 0, 1).unsqueeze(0)  # (1, H, L, L)
        else:
            p = torch.zeros(bk.g * bk.l, dtype=pos.dtype, device=dev)
            p[bk.slots] = pos
            p = p.view(bk.g, bk.l)  # (G, L); padded slots are masked below
            b = bias(p[:, None, :] - p[:, :, None]).permute(0, 3, 1, 2)  # (G, H, L, L)
        if bk.mask is not None:
            b = b.masked_fill(~bk.mask, float("-inf"))  # (G, H, L, L)
        bk.bias = b


def run_layers(layers: nn.ModuleList, x: Tensor, packing: Packing) -> Tensor:
    """``x``: ``(N, D)`` embedded real tokens (the caller's temporary: it may be overwritten) -> the last
    layer's ``(N, D)``."""
    for layer in layers:
        x = layer(x, packing.buckets, owned=True)
    return x
