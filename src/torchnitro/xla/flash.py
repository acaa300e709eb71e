"""Flash attention for the TPU path: a Pallas kernel (forward and backward) and a blockwise jnp fallback.

Math (FlashAttention-2, Dao 2023, arXiv:2307.08691): for one query block ``q`` (bq, D) the kernel
walks the key/value blocks ``k_j, v_j`` (bk, D) keeping a running row max ``m``, normaliser ``l``
and output ``acc``::

    s = q k_j^T * scale              (bq, bk), causal / length mask -> -inf
    m' = max(m, rowmax(s));  p = exp(s - m');  a = exp(m - m')
    l = a l + rowsum(p);  acc = a acc + p v_j;  m = m'
    o = acc / l,   lse = m + log(l)

so the (T, T) score matrix never exists. The backward recomputes ``p = exp(s - lse)`` per block:
``dv = p^T do``, ``dp = do v^T``, ``ds = p (dp - delta)`` with ``delta = rowsum(o * do)``,
``dk = ds^T q * scale``, ``dq = ds k * scale``; one kernel accumulates dk/dv over query blocks,
another dq over key blocks (no atomics). ``jax.custom_vjp`` ties them together.

Pallas kernels are not partitioned by XLA's SPMD partitioner: ``sharded_flash_attention`` runs the
kernel per shard under ``jax.shard_map`` with batch and heads split (attention never mixes either).
On CPU the kernels run with ``interpret=True`` (the default off TPU); ``blockwise_attention`` is the
same online softmax in plain jnp (``lax.scan`` over key blocks), for backends Pallas cannot target.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchnitro.errors import ConfigError, ShapeError

__all__ = ["ATTENTION_IMPLS", "reference_attention", "blockwise_attention", "flash_attention",
           "sharded_flash_attention"]

ATTENTION_IMPLS = ("plain", "blockwise", "flash")  # LMConfig.attention values
_NEG = -1e30  # finite "minus infinity": a fully masked block gives exp(-1e30 - m) = 0, never NaN


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True,
                        scale: float | None = None) -> jax.Array:
    """Plain softmax attention on (B, H, T, D) inputs: the oracle for the kernels."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * scale  # (B, H, T, S)
    if causal:
        T, S = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((T, S), bool)), s, _NEG)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ShapeError(f"flash attention: received q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "expected three equal (batch, heads, seq, head_dim) shapes (repeat GQA K/V heads first)")
    if block < 1:
        raise ConfigError(f"flash attention: block={block}; expected a positive block size (128 on TPU)")


def _pad_seq(x: jax.Array, t_pad: int) -> jax.Array:
    return x if x.shape[2] == t_pad else jnp.pad(x, ((0, 0), (0, 0), (0, t_pad - x.shape[2]), (0, 0)))


# ---------------------------------------------------------------- blockwise jnp fallback

def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True, scale: float | None = None,
                        block: int = 128) -> jax.Array:
    """Online-softmax attention over key blocks with ``lax.scan``; (B, H, T, D) in and out.

    Differentiated by JAX through the scan (it saves one (T, block) probability tile per step), so
    it bounds the forward's memory, not the backward's; the Pallas kernel bounds both.
    """
    _check(q, k, v, block)
    B, H, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bk = min(block, T)
    n = -(-T // bk)
    kb = _pad_seq(k, n * bk).reshape(B, H, n, bk, D).transpose(2, 0, 1, 3, 4)  # (n, B, H, bk, D)
    vb = _pad_seq(v, n * bk).reshape(B, H, n, bk, D).transpose(2, 0, 1, 3, 4)
    rows = jnp.arange(T)[:, None]

    def body(carry: Any, xs: Any) -> Any:
        m, l, acc = carry
        j, kj, vj = xs
        s = jnp.einsum("bhtd,bhsd->bhts", q, kj) * scale  # (B, H, T, bk)
        cols = j * bk + jnp.arange(bk)[None, :]
        keep = (cols < T) & (cols <= rows) if causal else (cols < T)
        s = jnp.where(keep, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        a = jnp.exp(m - m_new)
        return (m_new, a * l + p.sum(-1), a[..., None] * acc + jnp.einsum("bhts,bhsd->bhtd", p, vj)), None

    init = (jnp.full((B, H, T), _NEG, q.dtype), jnp.zeros((B, H, T), q.dtype), jnp.zeros_like(q))
    (m, l, acc), _ = lax.scan(body, init, (jnp.arange(n), kb, vb))
    return acc / l[..., None]


# ---------------------------------------------------------------- Pallas kernels

def _scores(q: jax.Array, k: jax.Array, scale: float, qi: Any, kj: Any, bq: int, bk: int, seq: int,
            causal: bool) -> jax.Array:
    """Masked scores of one (bq, bk) tile; rows/cols are absolute positions."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale  # (bq, bk)
    rows = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    keep = cols < seq
    if causal:
        keep = keep & (cols <= rows)
    return jnp.where(keep, s, _NEG)


def _fwd_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, lse_ref: Any, *, scale: float, bq: int, bk: int,
                seq: int, causal: bool) -> None:
    qi = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32)  # (bq, D)
    n_kv = k_ref.shape[0] // bk
    hi = jnp.minimum(n_kv, ((qi + 1) * bq + bk - 1) // bk) if causal else n_kv  # skip blocks above the diagonal

    def body(j: Any, carry: Any) -> Any:
        m, l, acc = carry
        k = k_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)  # (bk, D)
        v = v_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        s = _scores(q, k, scale, qi, j, bq, bk, seq, causal)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))  # (bq, 1)
        p = jnp.exp(s - m_new)
        a = jnp.exp(m - m_new)
        acc = a * acc + lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, a * l + p.sum(axis=1, keepdims=True), acc

    D = q.shape[-1]
    init = (jnp.full((bq, 1), _NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, hi, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)  # (bq, 1)


def _dkv_kernel(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, dk_ref: Any,
                dv_ref: Any, *, scale: float, bq: int, bk: int, seq: int, causal: bool) -> None:
    kj = pl.program_id(2)
    k = k_ref[...].astype(jnp.float32)  # (bk, D)
    v = v_ref[...].astype(jnp.float32)
    n_q = q_ref.shape[0] // bq
    lo = (kj * bk) // bq if causal else 0  # query blocks wholly above this key block see none of it

    def body(i: Any, carry: Any) -> Any:
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q = q_ref[rows, :].astype(jnp.float32)  # (bq, D)
        do = do_ref[rows, :].astype(jnp.float32)
        p = jnp.exp(_scores(q, k, scale, i, kj, bq, bk, seq, causal) - lse_ref[rows, :])  # (bq, bk)
        dv = dv + lax.dot_general(p, do, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # (bq, bk)
        ds = p * (dp - delta_ref[rows, :])
        dk = dk + lax.dot_general(ds, q, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, n_q, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, dq_ref: Any, *,
               scale: float, bq: int, bk: int, seq: int, causal: bool) -> None:
    qi = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32)  # (bq, D)
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...], delta_ref[...]  # (bq, 1)
    n_kv = k_ref.shape[0] // bk
    hi = jnp.minimum(n_kv, ((qi + 1) * bq + bk - 1) // bk) if causal else n_kv

    def body(j: Any, dq: Any) -> Any:
        cols = pl.ds(j * bk, bk)
        k = k_ref[cols, :].astype(jnp.float32)  # (bk, D)
        v = v_ref[cols, :].astype(jnp.float32)
        p = jnp.exp(_scores(q, k, scale, qi, j, bq, bk, seq, causal) - lse)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return dq + lax.dot_general(p * (dp - delta), k, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _specs(bq: int, bk: int, t: int, d: int) -> tuple[Any, Any, Any, Any]:
    """BlockSpecs over grid (B, H, blocks): one query block, one key block, a whole sequence, a row vector."""
    q_blk = pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
    k_blk = pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, h, j, 0))
    whole = pl.BlockSpec((None, None, t, d), lambda b, h, i: (b, h, 0, 0))
    return q_blk, k_blk, whole, pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float, bq: int, bk: int,
               seq: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    B, H, T, D = q.shape  # T: padded to a multiple of both blocks
    q_blk, _, whole, row = _specs(bq, bk, T, D)
    kern = functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk, seq=seq, causal=causal)
    return pl.pallas_call(
        kern, grid=(B, H, T // bq), in_specs=[q_blk, whole, whole], out_specs=[q_blk, row],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32)],
        interpret=interpret, name="flash_fwd")(q, k, v)


def _flash_bwd(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array, *,
               causal: bool, scale: float, bq: int, bk: int, seq: int,
               interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    B, H, T, D = q.shape
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)  # (B, H, T, 1)
    q_blk, k_blk, whole, row = _specs(bq, bk, T, D)
    whole_row = pl.BlockSpec((None, None, T, 1), lambda b, h, i: (b, h, 0, 0))
    kw = dict(scale=scale, bq=bq, bk=bk, seq=seq, causal=causal)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **kw), grid=(B, H, T // bk),
        in_specs=[whole, k_blk, k_blk, whole, whole_row, whole_row], out_specs=[k_blk, k_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret, name="flash_bwd_dkv")(q, k, v, do, lse, delta)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **kw), grid=(B, H, T // bq),
        in_specs=[q_blk, whole, whole, q_blk, row, row], out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=interpret, name="flash_bwd_dq")(
            q, k, v, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float, bq: int, bk: int, seq: int,
           interpret: bool) -> jax.Array:
    return _flash_fwd(q, k, v, causal=causal, scale=scale, bq=bq, bk=bk, seq=seq, interpret=interpret)[0]


def _flash_vjp_fwd(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float, bq: int, bk: int, seq: int,
                   interpret: bool) -> tuple[jax.Array, tuple]:
    o, lse = _flash_fwd(q, k, v, causal=causal, scale=scale, bq=bq, bk=bk, seq=seq, interpret=interpret)
    return o, (q, k, v, o, lse)  # residuals: inputs, output and one float per row, no (T, T) tile


def _flash_vjp_bwd(causal: bool, scale: float, bq: int, bk: int, seq: int, interpret: bool, res: tuple,
                   do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _flash_bwd(*res, do, causal=causal, scale=scale, bq=bq, bk=bk, seq=seq, interpret=interpret)


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True, scale: float | None = None,
                    block: int = 128, interpret: bool | None = None) -> jax.Array:
    """Pallas flash attention on (B, H, T, D) inputs, differentiable (custom VJP with Pallas backward kernels).

    ``block`` is the query and key block (128 fills a TPU MXU tile; shorter sequences use one
    block of the whole, rounded up to 8). A sequence that is not a multiple of the block is padded
    and the padded keys masked. ``interpret`` defaults to True off TPU (Pallas' interpreter on CPU).
    """
    _check(q, k, v, block)
    T = q.shape[2]
    b = min(block, -(-T // 8) * 8)
    t_pad = -(-T // b) * b
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o = _flash(_pad_seq(q, t_pad), _pad_seq(k, t_pad), _pad_seq(v, t_pad), causal, scale, b, b, T, interpret)
    return o[:, :, :T]


def sharded_flash_attention(mesh: Any, spec: Any, **kw: Any) -> Callable[[jax.Array, jax.Array, jax.Array],
                                                                          jax.Array]:
    """``flash_attention`` run per shard under ``jax.shard_map``; ``spec`` is the (B, H, T, D) PartitionSpec.

    Only batch and heads may be split: a split sequence or head dim would need ring attention.
    """
    if len(spec) > 2 and any(s is not None for s in tuple(spec)[2:]):
        raise ConfigError(f"sharded flash attention: spec {spec} splits the sequence or head dim; "
                          "only (batch, heads) may be sharded")
    fn = functools.partial(flash_attention, **kw)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
